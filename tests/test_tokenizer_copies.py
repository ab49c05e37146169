"""The pool remembers each served model's tokenizer (datapool/tokenizer_copies.py): a pool
reopened with no vLLM listing its models still decodes its steps' token IDs in the token view.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from tests_support import free_port
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from datapool import tokenizer_copies
from datapool.settings import PoolSettings
from datapool.tokenizer_copies import TokenizerCopies
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from gateway.tokenizer_dirs import TokenizerChoice, TokenizerDirs
from trajgate.vllm_server import VLLMServer


@pytest.fixture(autouse=True)
def _no_tokenizer_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TRAJGATE_TOKENIZER_DIR: the view must find the tokenizer by itself."""
    monkeypatch.delenv("TRAJGATE_TOKENIZER_DIR", raising=False)


def tokenizer_json(*words: str) -> str:
    """A real (word-level) tokenizer's JSON: a copy is kept only when it loads as one."""
    vocab = {word: i for i, word in enumerate(("[UNK]", *words))}
    return Tokenizer(WordLevel(vocab, unk_token="[UNK]")).to_str()


def test_models_sharing_a_tokenizer_share_one_copy_found_again_after_a_restart(
    tmp_path: Path,
) -> None:
    base, other = tmp_path / "base", tmp_path / "other"
    base_text, other_text = tokenizer_json("base"), tokenizer_json("other")
    for directory, text in ((base, base_text), (other, other_text)):
        directory.mkdir()
        (directory / "tokenizer.json").write_text(text)
    copies = TokenizerCopies(tmp_path / "pool" / "tokenizers")
    first = copies.remember("base", base)
    assert copies.remember("policy-v1", base) == first  # the same file: one copy
    assert (first / "tokenizer.json").read_text() == base_text
    assert copies.shared_directory() == first
    (base / "tokenizer.json").write_text(tokenizer_json("changed"))  # the source may change
    reopened = TokenizerCopies(tmp_path / "pool" / "tokenizers")
    assert reopened.directory_of("policy-v1") == first
    assert (first / "tokenizer.json").read_text() == base_text
    second = reopened.remember("other", other)
    assert second != first
    assert reopened.directory_of("other") == second
    assert reopened.shared_directory() is None  # two tokenizers: no single one to guess
    assert reopened.directory_of("never-served") is None
    assert sorted(p.name for p in (tmp_path / "pool" / "tokenizers").iterdir()) == sorted(
        ["models.json", first.name, second.name]
    )


def test_a_link_out_of_the_model_directory_is_never_copied(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").symlink_to(secret)
    copies = TokenizerCopies(tmp_path / "pool" / "tokenizers")
    with pytest.raises(ValueError, match="outside"):
        copies.remember("policy", model)
    assert copies.directory_of("policy") is None
    pool_files = [p for p in (tmp_path / "pool").rglob("*") if p.is_file()]
    assert pool_files == []


def test_a_hugging_face_snapshot_link_into_its_blobs_is_followed(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text(tokenizer_json("hub"))
    snapshot = repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(Path("..", "..", "blobs", "abc123"))
    copy = TokenizerCopies(tmp_path / "pool").remember("policy", snapshot)
    assert (copy / "tokenizer.json").read_text() == tokenizer_json("hub")


def test_a_file_that_is_not_a_tokenizer_or_is_too_large_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    copies = TokenizerCopies(tmp_path / "pool")
    with pytest.raises(ValueError, match="does not load as a tokenizer"):
        copies.remember("policy", model)
    (model / "tokenizer.json").write_text(tokenizer_json("w" * 600))
    monkeypatch.setattr(tokenizer_copies, "TOKENIZER_MAX_BYTES", 512)
    with pytest.raises(ValueError, match="larger than 512 bytes"):
        copies.remember("policy", model)
    assert copies.directory_of("policy") is None
    assert [p for p in (tmp_path / "pool").rglob("*") if p.is_file()] == []


def test_a_model_listed_without_a_root_is_said_so_not_served_from_none() -> None:
    dirs = TokenizerDirs()
    dirs._add([{"id": "emulated", "object": "model"}, {"id": "far", "root": "/nowhere"}])
    assert dirs.note("emulated") == (
        "the model list names no directory (root) for 'emulated'; "
        "set TRAJGATE_TOKENIZER_DIR to a copy of it"
    )
    assert dirs.note("far").startswith("vLLM serves 'far' from '/nowhere', which has no")


def test_a_reopened_pool_chooses_its_copy_when_no_replica_lists_the_model(
    tmp_path: Path,
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text(tokenizer_json("base"))
    listed = [
        {"id": "base", "root": str(base), "parent": None},
        {"id": "policy-v3", "root": str(tmp_path / "adapters" / "v3"), "parent": "base"},
    ]

    def models(request: httpx.Request) -> httpx.Response:  # vLLM's /v1/models, faked
        return httpx.Response(200, json={"object": "list", "data": listed})

    live = TokenizerDirs(copies=TokenizerCopies(tmp_path / "pool"))

    async def learn() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(models)) as client:
            await live.learn(client, ["http://vllm"], 1.0)

    asyncio.run(learn())
    assert live.choose("policy-v3", None) == TokenizerChoice(
        base, "vLLM /v1/models root of 'policy-v3'"
    )
    reopened = TokenizerDirs(copies=TokenizerCopies(tmp_path / "pool"))  # nothing learnt
    copy = TokenizerCopies(tmp_path / "pool").directory_of("base")
    assert copy is not None and copy.parent == tmp_path / "pool"
    for model in ("base", "policy-v3"):
        assert reopened.choose(model, None) == TokenizerChoice(
            copy, f"the pool's copy of the tokenizer of {model!r}"
        )
    # an adapter that was never listed while the gateway ran: the pool's only tokenizer
    assert reopened.choose("policy-v9", None) == TokenizerChoice(
        copy, "the pool's copy of the only tokenizer it remembers"
    )
    # without copies (a gateway built before this), nothing to decode with
    assert TokenizerDirs().choose("base", None) is None


def test_the_token_view_of_a_reopened_pool_decodes_without_vllm(
    vllm: VLLMServer, sqlite_pool: PoolSettings
) -> None:
    """The real vLLM serves one call; the gateway is stopped; a gateway on the same pool whose
    upstream answers nothing shows the step's tokens as text, from the pool's copy."""
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port())
    server = BackgroundServer(create_app(settings, sqlite_pool), port=settings.port).start()
    try:
        client = OpenAI(base_url=f"{server.url}/t/reopen-1/v1", api_key="unused")
        client.chat.completions.create(
            model=vllm.served_model_name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
        )
        deadline = time.monotonic() + 30
        while TokenizerCopies(sqlite_pool.data_dir / "tokenizers").shared_directory() is None:
            assert time.monotonic() < deadline, "the gateway kept no copy of the tokenizer"
            time.sleep(0.2)
        step_id = httpx.get(f"{server.url}/api/trajectories/reopen-1").json()["steps"][0]["id"]
        live_view = httpx.get(f"{server.url}/api/steps/{step_id}/tokens").json()
    finally:
        server.stop()
    assert live_view["token_texts"] is not None

    dead = f"http://127.0.0.1:{free_port()}"  # no vLLM: nothing lists any model
    settings = GatewaySettings(upstream_url=dead, port=free_port())
    reopened = BackgroundServer(create_app(settings, sqlite_pool), port=settings.port).start()
    try:
        view = httpx.get(f"{reopened.url}/api/steps/{step_id}/tokens").json()
    finally:
        reopened.stop()
    assert view["token_texts"] == live_view["token_texts"]
    assert view["tokenizer"]["source"] == (
        f"the pool's copy of the tokenizer of {vllm.served_model_name!r}"
    )
    assert view["tokenizer_note"] is None
