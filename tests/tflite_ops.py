"""What a .tflite file's signatures hold, read from its flatbuffer: for tests that check an
export's graph (which operators, reading which inputs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ai_edge_litert import schema_py_generated as schema


@dataclass(frozen=True)
class SignatureGraph:
    """One signature: its inputs' tensor indices by name, and its operators in order as
    (builtin operator name, input tensor indices)."""

    inputs: dict[str, int]
    operators: list[tuple[str, list[int]]]


def signature_graphs(model_file: Path) -> dict[str, SignatureGraph]:
    """Every signature of ``model_file``, by key."""
    model = schema.Model.GetRootAs(model_file.read_bytes(), 0)
    names = {code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")}
    # Operator codes below 127 may sit in the deprecated field only; the larger of the two is the code.
    kinds = [names[max(code.BuiltinCode(), code.DeprecatedBuiltinCode())]
             for code in (model.OperatorCodes(i) for i in range(model.OperatorCodesLength()))]
    graphs = {}
    for index in range(model.SignatureDefsLength()):
        signature = model.SignatureDefs(index)
        graph = model.Subgraphs(signature.SubgraphIndex())
        inputs = {signature.Inputs(i).Name().decode(): signature.Inputs(i).TensorIndex()
                  for i in range(signature.InputsLength())}
        operators = [(kinds[op.OpcodeIndex()], op.InputsAsNumpy().tolist())
                     for op in (graph.Operators(i) for i in range(graph.OperatorsLength()))]
        graphs[signature.SignatureKey().decode()] = SignatureGraph(inputs, operators)
    return graphs
