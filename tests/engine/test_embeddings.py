"""/v1/embeddings on the real engine (bundled model), on a loopback socket, driven by the official openai SDK."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import openai
import pytest

from backend_engine.batch import build_forward_batch
from backend_engine.http.openai_protocol.embeddings import MAX_INPUTS, parse_embedding_request
from backend_engine.http.openai_protocol.requests import RequestParser
from backend_engine.http.server import EngineServer
from backend_engine.sequence import SamplingParams, Sequence

from .served import MODEL, running_server, wait_idle

CAT = "The cat sat on the mat."
TEXTS = [CAT, "A cat was sitting on the mat.", "Quarterly revenue grew by ten percent."]
# A small step budget, so the long inputs below are prefilled in several passes.
STEP_TOKENS = 64


@pytest.fixture(scope="module")
def served(make_engine):
    server = EngineServer(make_engine(max_num_batched_tokens=STEP_TOKENS))
    with running_server(server) as url:
        yield server, url


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="x")


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_float_and_base64_are_the_same_unit_vectors(client, served):
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    raw = httpx.post(served[1] + "/v1/embeddings", json={"input": TEXTS}).json()
    assert isinstance(raw["data"][0]["embedding"], list)  # float is the server's default
    b64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    hidden = served[0].engine.loaded.config.hidden_size
    assert vectors(floats).shape == (3, hidden)
    np.testing.assert_array_equal(vectors(floats), vectors(b64))
    np.testing.assert_allclose(np.linalg.norm(vectors(floats), axis=1), 1.0, atol=1e-5)
    tokens = [len(served[0].engine.tokenizer.encode(t)) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(tokens)
    assert floats.model == MODEL and floats.object == "list"


def test_similar_texts_are_closer_than_unrelated_ones(client):
    v = vectors(client.embeddings.create(model=MODEL, input=TEXTS))
    assert v[0] @ v[1] > v[0] @ v[2] + 0.05


def test_a_batch_equals_its_inputs_one_by_one(client):
    batch = vectors(client.embeddings.create(model=MODEL, input=TEXTS))
    singles = np.concatenate([vectors(client.embeddings.create(model=MODEL, input=t)) for t in TEXTS])
    np.testing.assert_allclose(batch, singles, atol=1e-5)


def test_dimensions_keep_the_leading_components_renormalised(client):
    full = vectors(client.embeddings.create(model=MODEL, input=CAT))[0]
    short = vectors(client.embeddings.create(model=MODEL, input=CAT, dimensions=64))[0]
    assert short.shape == (64,)
    np.testing.assert_allclose(short, unit(full[:64]), atol=1e-6)


def test_token_ids_embed_as_their_text_does(client, served):
    ids = served[0].engine.tokenizer.encode(CAT)
    by_text = vectors(client.embeddings.create(model=MODEL, input=CAT))
    by_ids = vectors(client.embeddings.create(model=MODEL, input=ids))
    by_id_lists = vectors(client.embeddings.create(model=MODEL, input=[ids, ids[:3]]))
    np.testing.assert_array_equal(by_ids, by_text)
    np.testing.assert_allclose(by_id_lists[0], by_text[0], atol=1e-5)  # batched: other matmul shapes


def test_vector_is_the_mean_of_the_final_hidden_states(client, served):
    """Through the LM head, the mean of the final hidden states is the mean of every position's logits: computed
    here in one pass over a scratch KV cache, while the server prefilled the input in several passes."""
    engine = served[0].engine
    ids = engine.tokenizer.encode(" ".join(TEXTS * 12))
    assert len(ids) > 2 * STEP_TOKENS
    [v] = vectors(client.embeddings.create(model=MODEL, input=ids))

    block_size = engine.config.block_size
    nblocks = -(-len(ids) // block_size)
    seq = Sequence(0, "reference", ids, SamplingParams())
    seq.block_table = list(range(nblocks))
    batch, _ = build_forward_batch([(seq, len(ids))], block_size)
    batch.logits_indices = np.arange(len(ids))
    logits = engine.model.forward(batch, engine.model.allocate_kv_cache(nblocks, block_size))
    np.testing.assert_allclose(unit(v @ engine.model.w.lm_head), unit(logits.mean(axis=0)), atol=2e-5)


def test_embeddings_interleave_with_generation_and_free_every_block(client, served):
    """A chat stream and a batch of long embedding inputs at once: both finish, nothing stays allocated."""
    engine = served[0].engine
    long_inputs = [" ".join([t] * 20) for t in TEXTS] * 4
    answers: list[str] = []

    def chat() -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=24, stream=True
        )
        answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    thread = threading.Thread(target=chat)
    thread.start()
    together = vectors(client.embeddings.create(model=MODEL, input=long_inputs))
    thread.join(timeout=120)
    assert answers and answers[0]
    wait_idle(served[0])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    alone = vectors(client.embeddings.create(model=MODEL, input=long_inputs[:3]))
    np.testing.assert_allclose(together[:3], alone, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": []}, "input", None),
        ({"input": ""}, "input", None),
        ({"input": 5}, "input", None),
        ({"input": ["a", [1, 2]]}, "input", None),
        ({"input": [True, 2]}, "input", None),
        ({"input": ["x"] * 2049}, "input", None),
        ({"input": [[1, 2], [10**9]]}, "input", None),
        ({"input": [1] * 5000}, "input", None),
        ({"input": "x", "dimensions": 0}, "dimensions", None),
        ({"input": "x", "dimensions": 577}, "dimensions", None),
        ({"input": "x", "dimensions": True}, "dimensions", "invalid_type"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "x", "user": 7}, "user", "invalid_type"),
        ({"input": "x", "pooling": "cls"}, "pooling", "unknown_parameter"),
    ],
)
def test_bad_requests_get_400_in_openai_shape(served, body, param, code):
    r = httpx.post(served[1] + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    if code:
        assert err["code"] == code


@pytest.mark.parametrize("batched", [False, True])
def test_token_ids_longer_than_the_context_are_refused_before_they_are_walked(served, batched):
    """Every id of an input was checked before its length: ten million ids took seconds of a core before the 400.
    The last "id" here is no id at all, so only an input measured before it is walked is refused for its length."""
    ids = [84] * (served[0].engine.max_model_len + 1) + ["x"]
    r = httpx.post(served[1] + "/v1/embeddings", json={"input": [ids] if batched else ids}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "input"


def test_a_flat_list_of_token_ids_is_one_input_however_long(make_engine):
    """A flat list of token ids is one input, but its ids were counted as inputs: a 2,100-token input, inside the
    context, was refused as more than 2048 inputs."""
    parser = RequestParser(make_engine(kv_cache_bytes=128 << 20), MODEL)
    ids = [84] * (MAX_INPUTS + 52)
    assert parser.engine.max_model_len > len(ids)
    assert parse_embedding_request({"input": ids}, parser).inputs == [ids]


@pytest.mark.parametrize("value", ["word " * 1_600_000, ["hi", "word " * 1_600_000]])
def test_a_text_too_long_for_any_context_is_refused_untokenized(served, value):
    """An input was tokenized whole before its length was checked: 8 MB of text cost many seconds of a core the
    engine's steps share, only to be refused."""
    started = time.monotonic()
    r = httpx.post(served[1] + "/v1/embeddings", json={"input": value}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert time.monotonic() - started < 8  # tokenized first, it took 9-10 s


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")
