"""Hugging Face tokenizers as transformers runs them: special tokens and BOS from the tokenizer's own config, the
chat template carried into the artifact and listed in the manifest."""
from __future__ import annotations

from pathlib import Path

import pytest

from picompile.errors import ArtifactError
from picompile.formats.tokenizers import HFTokenizer, load_tokenizer, load_tokenizer_entry, save_tokenizer

SMOL_GGUF = Path.home() / ".cache/picompile/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "picompile/data/default_model"


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer (from its GGUF) saved as transformers saves it: tokenizer.json,
    tokenizer_config.json, chat_template.jinja."""
    if not SMOL_GGUF.is_file():
        pytest.skip(f"{SMOL_GGUF} is absent")
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smol_tok")
    AutoTokenizer.from_pretrained(str(SMOL_GGUF.parent), gguf_file=SMOL_GGUF.name).save_pretrained(str(out))
    return out


def test_smollm2_encodes_as_transformers(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(smol_dir))
    tok = load_tokenizer("hf", smol_dir)
    text = "Hello, how are you? Naïve café ✓"
    assert tok.encode(text) == ref(text).input_ids
    assert tok.encode(text)[0] != tok.bos_id  # its config says no BOS (the old path prepended id 1)
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_carried_and_listed(smol_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from picompile.formats.manifest_schema import check_tokenizer

    tok = load_tokenizer("hf", smol_dir)
    entry = save_tokenizer(tok, tmp_path)
    assert entry["chat_template"] == "tokenizer/chat_template.jinja" and entry["chat_template"] in entry["files"]
    check_tokenizer(entry)
    back = load_tokenizer_entry(entry, tmp_path)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3?"}]
    ref = AutoTokenizer.from_pretrained(str(smol_dir))
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(back, HFTokenizer) and back.apply_chat_template(messages) == list(want)
    with pytest.raises(ArtifactError, match="tokenizer.chat_template must be one of tokenizer.files"):
        check_tokenizer({**entry, "chat_template": "tokenizer/other.jinja"})
    (tmp_path / "tokenizer/chat_template.jinja").write_text("{{ 'tampered' }}")
    with pytest.raises(ArtifactError, match="fails its sha256 check"):
        load_tokenizer_entry(entry, tmp_path)


def test_default_model_matches_autotokenizer() -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    tok = load_tokenizer("hf", DEFAULT_MODEL)
    for text in ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak."]:
        assert tok.encode(text) == ref(text).input_ids
    assert tok.encode("ROMEO:", bos=False) == ref("ROMEO:", add_special_tokens=False).input_ids
    assert getattr(tok, "chat_template") is None
