"""ChatTemplate renders conversations the way Hugging Face templates expect."""

from __future__ import annotations

import pytest

from runtime.components.chat_template import ChatTemplate
from runtime.errors import InvalidArgumentError

# The shape of SmolLM2's / Qwen's ChatML template.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_renders_chatml_with_generation_prompt() -> None:
    text = ChatTemplate(CHATML).render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_generation_prompt_can_be_left_out() -> None:
    text = ChatTemplate(CHATML).render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n"


def test_special_token_texts_reach_the_template() -> None:
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_special_token_texts_must_be_text() -> None:
    """bos_token=None rendered as the text 'None' at the head of every prompt."""
    for name in ("bos_token", "eos_token"):
        with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {name}=None, expected a str"):
            ChatTemplate("{{ bos_token }}{{ messages[0].content }}", **{name: None})


def test_raise_exception_in_a_template_is_an_invalid_argument() -> None:
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert template.render([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(InvalidArgumentError, match="first must be user"):
        template.render([{"role": "assistant", "content": "a"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "empty"),
        (None, "messages is NoneType, expected a list"),
        ("hello", "messages is str, expected a list"),
        (["hello"], r"messages\[0\] is str"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role='wizard'"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
    ],
)
def test_bad_messages_are_named(messages: list, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ChatTemplate(CHATML).render(messages)


def test_a_template_cannot_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgumentError):
        template.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", ["", "   ", "{% for %}"])
def test_unusable_templates_are_refused(source: str) -> None:
    with pytest.raises(InvalidArgumentError):
        ChatTemplate(source)


@pytest.mark.parametrize("source", ["{{ messages[0].content + 1 }}", "{{ 1 // 0 }}", "{{ '%d' % messages[0].content }}",
                                    "{{ range(10**9) | list }}"])
def test_a_template_that_fails_in_python_is_an_invalid_argument(source: str) -> None:
    """A template is data from a downloaded file: its TypeError, ZeroDivisionError or
    OverflowError escaped as such (only Jinja's own errors were turned into INVALID_ARGUMENT)."""
    with pytest.raises(InvalidArgumentError, match="chat template failed on these messages: "):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])



def test_hugging_face_s_template_environment_is_the_one_templates_get() -> None:
    """Templates are written for transformers' environment: {% break %} and {% continue %}
    (its loopcontrols extension) and {% generation %} blocks did not parse here, strftime_now
    was undefined, and Jinja's own tojson escaped <, >, &, ' and every non-ASCII character
    where transformers' writes them as they are."""
    message = [{"role": "user", "content": "<é & 'x'>"}, {"role": "assistant", "content": "second"}]
    first_only = ChatTemplate("{% for m in messages %}{% if not loop.first %}{% break %}{% endif %}{{ m.content }}"
                              "{% endfor %}")
    assert first_only.render(message) == "<é & 'x'>"
    skipping = ChatTemplate("{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}"
                            "{% endfor %}")
    assert skipping.render(message) == "second"
    assert ChatTemplate("{{ messages[0].content | tojson }}").render(message) == '"<é & \'x\'>"'
    assert ChatTemplate("{{ messages[0] | tojson(indent=1) }}").render(message) == (
        '{\n "role": "user",\n "content": "<é & \'x\'>"\n}')
    marked = ChatTemplate("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                          "{% endgeneration %}{% else %}{{ m.content }}|{% endif %}{% endfor %}")
    assert marked.render(message) == "<é & 'x'>|second"
    year = ChatTemplate("{{ strftime_now('%Y') }}").render(message)
    assert year.isdigit() and int(year) >= 2024


# The shape of Gemma 2's and Mistral's first templates: user and model turns only, a system message skipped.
NO_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<u>' + message['content'] + '</u>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<a>' + message['content'] + '</a>' }}{% endif %}{% endfor %}"
)


def test_a_system_message_is_joined_to_the_next_user_turn_where_the_template_has_no_place_for_it() -> None:
    """The template skipped the system message: the instruction vanished from the prompt without a word."""
    template = ChatTemplate(NO_SYSTEM)
    assert not template.renders_system
    text = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}])
    assert text == "<u>Be brief.\n\nHi</u><a>Hello</a><u>Again</u>"


def test_a_system_message_with_no_user_turn_after_it_becomes_a_user_turn() -> None:
    text = ChatTemplate(NO_SYSTEM).render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                           {"role": "system", "content": "Now be formal."}])
    assert text == "<u>Hi</u><a>Hello</a><u>Now be formal.</u>"


def test_a_template_refusing_the_system_role_gets_it_in_the_user_turn() -> None:
    template = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                            "{% endif %}{{ m.content }}{% endfor %}")
    assert template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == "S\n\nU"


def test_a_template_with_a_system_slot_keeps_its_own_rendering() -> None:
    template = ChatTemplate(CHATML)
    assert template.renders_system
    assert template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
