"""/v1/rerank (and /rerank, /v2/rerank) and a decoder embedder, through real servers on
tiny random models, checked against ``transformers`` on the same weights: BERT and
XLM-RoBERTa cross-encoders, a Qwen3-Reranker-style yes/no decoder, and a Qwen3 embedder
with last-token pooling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from support.embed_models import build_cross_encoder, build_yes_no_reranker
from support.server_utils import Server, run_server

torch = pytest.importorskip("torch")

QUERY = "what is a JSON decoder?"
DOCS = [
    "The JSON decoder turns a string into Python objects.",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: naïve café, 東京, 🚀",
    "argparse parses the command line " * 8,
    "x",
]
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_models: Callable[..., Path]) -> dict:
    root = tmp_path_factory.mktemp("rerankers")
    qwen3 = tiny_models("qwen3")
    return {
        "chat": tiny_models("llama"),
        "qwen3": qwen3,
        "bert": build_cross_encoder(root / "bert", "bert"),
        "xlmr": build_cross_encoder(root / "xlmr", "xlm-roberta"),
        "yesno": build_yes_no_reranker(root / "yesno", qwen3),
    }


def _cross_encoder_scores(folder: Path, query: str, docs: list[str]) -> np.ndarray:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return torch.sigmoid(model(**enc).logits[:, 0]).numpy()


def _yes_no_scores(folder: Path, query: str, docs: list[str]) -> np.ndarray:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    out = []
    for d in docs:  # one at a time: no padding question for the reference
        text = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {d}"
        ids = (
            tok(PREFIX, add_special_tokens=False)["input_ids"]
            + tok(text, add_special_tokens=False)["input_ids"]
            + tok(SUFFIX, add_special_tokens=False)["input_ids"]
        )
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1, [no, yes]]
        out.append(torch.softmax(logits, dim=-1)[1].item())
    return np.array(out)


def _serve(folders: dict, *args: str) -> Iterator[Server]:
    with run_server(str(folders["chat"]), *args) as s:
        yield s


@pytest.fixture(scope="module")
def bert_server(folders: dict) -> Iterator[Server]:
    yield from _serve(
        folders,
        "--rerank-model", str(folders["bert"]), "--rerank-served-model-name", "bert-ce",
        "--embedding-model", str(folders["qwen3"]), "--embedding-served-model-name", "qwen3-emb",
    )  # fmt: skip


@pytest.fixture(scope="module")
def xlmr_server(folders: dict) -> Iterator[Server]:
    yield from _serve(folders, "--rerank-model", str(folders["xlmr"]), "--auto-truncate")


@pytest.fixture(scope="module")
def yesno_server(folders: dict) -> Iterator[Server]:
    yield from _serve(folders, "--rerank-model", str(folders["yesno"]))


def _rerank(server: Server, path: str = "/v1/rerank", **body: object) -> dict:
    r = server.http().post(path, json={"query": QUERY, "documents": DOCS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _scores(body: dict) -> np.ndarray:
    out = np.zeros(len(body["results"]))
    for r in body["results"]:
        out[r["index"]] = r["relevance_score"]
    return out


def test_bert_cross_encoder_matches_transformers(bert_server: Server, folders: dict) -> None:
    body = _rerank(bert_server, model="bert-ce")
    ref = _cross_encoder_scores(folders["bert"], QUERY, DOCS)
    np.testing.assert_allclose(_scores(body), ref, atol=1e-5)
    got = [r["relevance_score"] for r in body["results"]]
    assert got == sorted(got, reverse=True)
    assert [r["index"] for r in body["results"]] == list(np.argsort(-ref, kind="stable"))
    assert body["results"][0]["document"] == {"text": DOCS[body["results"][0]["index"]]}
    assert body["model"] == "bert-ce" and body["usage"]["total_tokens"] > 0


def test_xlm_roberta_cross_encoder_matches_transformers(xlmr_server: Server, folders: dict) -> None:
    body = _rerank(xlmr_server)  # model left out: the only rerank model
    ref = _cross_encoder_scores(folders["xlmr"], QUERY, DOCS)
    np.testing.assert_allclose(_scores(body), ref, atol=1e-5)


def test_yes_no_decoder_reranker_matches_transformers(yesno_server: Server, folders: dict) -> None:
    body = _rerank(yesno_server)
    ref = _yes_no_scores(folders["yesno"], QUERY, DOCS)
    np.testing.assert_allclose(_scores(body), ref, atol=1e-4)


def test_decoder_embedder_last_token_matches_transformers(
    bert_server: Server, folders: dict
) -> None:
    from transformers import AutoModel, AutoTokenizer

    texts = DOCS
    r = bert_server.client().embeddings.create(
        model="qwen3-emb", input=texts, encoding_format="float"
    )
    got = np.array([d.embedding for d in r.data])
    tok = AutoTokenizer.from_pretrained(str(folders["qwen3"]))
    model = AutoModel.from_pretrained(str(folders["qwen3"]), dtype=torch.float32).eval()
    ref = []
    for t in texts:
        with torch.no_grad():
            h = model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1].numpy()
        ref.append(h / np.linalg.norm(h))
    cos = (got * np.array(ref)).sum(1)
    assert cos.min() >= 0.9999


def test_top_n_return_documents_and_object_documents(bert_server: Server) -> None:
    docs = [{"text": d, "id": f"doc-{i}"} for i, d in enumerate(DOCS)]
    full = _rerank(bert_server, documents=docs)
    top = _rerank(bert_server, documents=docs, top_n=2, return_documents=False)
    assert [r["index"] for r in top["results"]] == [r["index"] for r in full["results"][:2]]
    assert all("document" not in r for r in top["results"])
    first = full["results"][0]
    assert first["document"] == docs[first["index"]]  # the object comes back whole
    assert len(_rerank(bert_server, top_n=50)["results"]) == len(DOCS)


def test_rerank_paths_agree(bert_server: Server) -> None:
    a = _rerank(bert_server, "/v1/rerank")
    b = _rerank(bert_server, "/rerank")
    c = _rerank(bert_server, "/v2/rerank", model="bert-ce")
    assert a["results"] == b["results"] == c["results"]
    assert c["meta"]["billed_units"]["search_units"] == 1


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "nope"}, 404, "model", "model_not_found"),
        ({"documents": []}, 400, "documents", "invalid_value"),
        ({"query": ""}, 400, "query", "invalid_value"),
        ({"top_n": 0}, 400, "top_n", "invalid_value"),
        ({"documents": [1, 2]}, 400, "documents[0]", "invalid_type"),
        ({"documents": [{"title": "no text"}]}, 400, "documents[0].text", None),
        ({"rank_fields": ["title"]}, 400, "rank_fields", "unsupported_value"),
        ({"max_chunks_per_doc": 2}, 400, "max_chunks_per_doc", "unsupported_parameter"),
        ({"documents": ["word " * 200]}, 400, "documents[0]", "context_length_exceeded"),
        ({"bogus": 1}, 400, "bogus", "unknown_parameter"),
    ],
)
def test_rerank_errors(
    bert_server: Server, body: dict, status: int, param: str, code: str | None
) -> None:
    r = bert_server.http().post("/v1/rerank", json={"query": QUERY, "documents": DOCS, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_truncation_flag_and_max_tokens_per_doc(xlmr_server: Server, folders: dict) -> None:
    long_doc = "the json decoder reads documents " * 60  # past the model's 128 tokens
    body = _rerank(xlmr_server, documents=[long_doc, DOCS[0]])
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folders["xlmr"]))
    model = AutoModelForSequenceClassification.from_pretrained(str(folders["xlmr"])).eval()
    enc = tok([QUERY] * 2, [long_doc, DOCS[0]], padding=True, truncation=True, max_length=128,
              return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        ref = torch.sigmoid(model(**enc).logits[:, 0]).numpy()
    np.testing.assert_allclose(_scores(body), ref, atol=1e-5)
    short = _rerank(xlmr_server, documents=[long_doc], max_tokens_per_doc=5)
    assert short["usage"]["total_tokens"] < 30


def test_no_embedding_model_served(yesno_server: Server) -> None:
    r = yesno_server.http().post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sentence_transformers": {"activation_fn": "torch.nn.Tanh"}}, "activation"),
        ({"num_labels": 2, "id2label": {"0": "a", "1": "b"}}, "2 labels"),
        ({"architectures": ["BertModel"]}, "ForSequenceClassification"),
    ],
)
def test_unsupported_cross_encoders_fail_at_load(
    folders: dict, tmp_path: Path, change: dict, message: str
) -> None:
    import json
    import shutil

    folder = shutil.copytree(folders["bert"], tmp_path / "ce")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match=message):
        with run_server(str(folders["chat"]), "--rerank-model", str(folder)):
            pass
