import pytest

from .conftest import reference


def test_chat_template_renders_reference_prompt(loaded):
    case = reference()["cases"][3]
    text = loaded.chat_template.render([{"role": "user", "content": "What is the capital of France?"}])
    assert loaded.tokenizer.encode(text) == case["prompt_ids"]


def test_chat_template_is_sandboxed(loaded):
    from backend_engine.model.chat_template import ChatTemplate, ChatTemplateError

    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("extra", [{"tools": 5}, {"tools": {"a": 1}}, {"tools": None}])
def test_a_request_value_that_breaks_the_template_is_the_requests_error(extra):
    """Templates walk tool lists; a request's chat_template_kwargs of another shape raised a TypeError (a 500)."""
    from backend_engine.model.chat_template import ChatTemplate, ChatTemplateError

    template = ChatTemplate("{% for t in tools %}{{ t['name'] + '\\n' }}{% endfor %}{{ messages[0]['content'] }}")
    assert template.render([{"role": "user", "content": "x"}], tools=[{"name": "a"}]) == "a\nx"
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}], **extra)


def test_special_tokens_parsed(loaded):
    tok = loaded.tokenizer
    assert tok.encode("<|im_start|>user")[:1] == [1]
    assert 2 in tok.eos_ids
    assert tok.decode([1, 4093], skip_special_tokens=True) == "user"
    assert tok.decode([1, 4093], skip_special_tokens=False) == "<|im_start|>user"


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🦀🚀 mix ✓", "tab\tand\nnewline  spaces"])
def test_streaming_detokenizer_never_breaks_utf8(loaded, text):
    tok = loaded.tokenizer
    ids = tok.encode(text)
    det = tok.detokenizer()
    pieces = [det.push(i) for i in ids] + [det.flush()]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == text == tok.hf.decode(ids)
    # At least one multi-byte character really was split across tokens in the emoji case.
    if "🦀" in text:
        assert any(p == "" for p in pieces[:-1])


def test_prompt_renderer_without_weights_matches_engine(loaded):
    from backend_engine.config import default_model_path
    from backend_engine.model import load_prompt_renderer
    from backend_engine.model.prompt import PromptError

    r = load_prompt_renderer(default_model_path())
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    assert r.chat_ids(msgs) == reference()["cases"][3]["prompt_ids"] == loaded.renderer.chat_ids(msgs)
    assert r.text_ids("Once upon a time") == [6403, 1980, 253, 655]
    assert r.text_ids("Once", add_bos=True) == [1, 6403]
    with pytest.raises(PromptError) as e:
        r.chat_ids([{"role": "user", "content": 5}])
    assert e.value.param == "messages"
