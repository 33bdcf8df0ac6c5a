"""prefix_keys.chat_template renders what transformers' apply_chat_template renders.

The node and a router render with this module, so it must agree with transformers on every
feature model templates use; a difference would silently split their keys.
"""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError
from transformers import AutoTokenizer

from prefix_keys.chat_template import TemplateError, compile_chat_template, template_variables

CONVERSATION = [
    {"role": "system", "content": "Answer <b>briefly</b> & 'politely' — \"é\"."},
    {"role": "user", "content": "hi\n  there"},
    {"role": "assistant", "content": "hello"},
]

TEMPLATES = {
    # transformers' tojson does not escape HTML (jinja2's own does) and takes json.dumps options
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
    # trim_blocks / lstrip_blocks: block tags on their own indented lines leave no whitespace
    "whitespace": (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m.role == 'system' %}\n"
        "[{{ m.content }}]\n"
        "    {% else %}\n"
        "<{{ m.role }}>{{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
    # namespace(), loop controls and dict(), as Llama and Qwen templates use them
    "namespace": (
        "{% set ns = namespace(count=0) %}{% for m in messages %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.count = ns.count + 1 %}"
        "{{ ns.count }}:{{ m.content }};{% if ns.count == 2 %}{% break %}{% endif %}{% endfor %}"
        "{{ dict(a=1, b=[2]) | tojson }}{{ tools is none }}{{ documents is none }}"
    ),
    # the assistant-mask tag renders its body
    "generation": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    ),
    "strftime": "{{ strftime_now('%Y') }}{{ eos_token }}{{ pad_token }}",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers(tokenizer, name, add_generation_prompt):
    source = TEMPLATES[name]
    expected = tokenizer.apply_chat_template(
        CONVERSATION,
        chat_template=source,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    variables = template_variables(
        CONVERSATION, add_generation_prompt, tokenizer.special_tokens_map
    )
    assert compile_chat_template(source).render(**variables) == expected


def test_raise_exception_is_a_template_error():
    template = compile_chat_template("{{ raise_exception('no tools here') }}")
    with pytest.raises(TemplateError, match="no tools here"):
        template.render(**template_variables(CONVERSATION, False, {}))


@pytest.mark.parametrize(
    "source",
    [
        "{% set ns = namespace(_secret=1) %}",  # underscore names on a namespace reach internals
        "{{ messages.append(1) }}",  # the immutable sandbox: a template cannot change its input
    ],
)
def test_sandbox_refuses_what_transformers_refuses(tokenizer, source):
    with pytest.raises(SecurityError):
        tokenizer.apply_chat_template(CONVERSATION, chat_template=source, tokenize=False)
    with pytest.raises(SecurityError):
        compile_chat_template(source).render(**template_variables(CONVERSATION, False, {}))


def test_a_template_that_does_not_compile_is_a_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        compile_chat_template("{% for m in messages %}")
