"""Tokenizers the runtime uses: llama2.c tokenizer.bin files and Hugging Face tokenizers (tokenizer.json
with its side files and chat template, through ``transformers.AutoTokenizer``).

Both implement the `Tokenizer` protocol. `save_tokenizer` copies a tokenizer's source file(s) into
an artifact directory and returns a manifest entry; `load_tokenizer_entry` (or `load_tokenizer`
with the entry's kind and first file) loads it back.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

from picompile.errors import ArtifactError, InputError, ModelLoadError

TOKENIZER_SUBDIR = "tokenizer"
_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")


@runtime_checkable
class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer."""

    bos_id: int | None
    eos_id: int | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# ----------------------------------------------------------------------------- llama2.c


@dataclass
class Llama2cTokenizer:
    """llama2.c's tokenizer.bin: sentencepiece-style pieces with scores, encoded as run.c does."""

    pieces: list[bytes]  # [vocab] raw bytes of every token ("<0x41>" for byte-fallback tokens)
    scores: list[float]  # [vocab] merge priority
    max_token_length: int
    bos_id: int | None = 1
    eos_id: int | None = 2
    source: Path | None = None  # the file it came from (copied by save_tokenizer)
    _lookup: dict[bytes, int] = field(init=False, repr=False)
    _byte_ids: dict[int, int] = field(init=False, repr=False)  # raw byte -> its "<0xXX>" token id
    _piece_bytes: list[bytes] = field(init=False, repr=False)  # [vocab] what each token decodes to
    _joinable: dict[tuple[int, int], bool] = field(init=False, repr=False)  # cache of _can_join

    def __post_init__(self) -> None:
        self._lookup = {}
        for i, p in enumerate(self.pieces):
            self._lookup.setdefault(p, i)
        self._byte_ids = {}
        self._piece_bytes = []
        for i, p in enumerate(self.pieces):
            m = _BYTE_PIECE.match(p)
            if m:
                self._byte_ids.setdefault(int(m.group(1), 16), i)
                self._piece_bytes.append(bytes([int(m.group(1), 16)]))
            else:
                self._piece_bytes.append(p)
        self._joinable = {}

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @classmethod
    def from_file(cls, path: Path, vocab_size: int | None = None) -> "Llama2cTokenizer":
        """Read a llama2.c tokenizer.bin: int32 max_token_length, then per token float32 score,
        int32 length, bytes. Without `vocab_size`, tokens are read until the end of the file."""
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"llama2.c tokenizer file {path} does not exist")
        data = path.read_bytes()
        if len(data) < 4:
            raise ModelLoadError(f"{path}: too short for a llama2.c tokenizer ({len(data)} bytes)")
        (max_len,) = struct.unpack_from("<i", data, 0)
        if not 0 < max_len <= 1 << 16:
            raise ModelLoadError(f"{path}: corrupt llama2.c tokenizer, max_token_length = {max_len}")
        pieces: list[bytes] = []
        scores: list[float] = []
        pos = 4
        while pos < len(data) and (vocab_size is None or len(pieces) < vocab_size):
            if pos + 8 > len(data):
                raise ModelLoadError(f"{path}: truncated llama2.c tokenizer in the record of token {len(pieces)}")
            score, n = struct.unpack_from("<fi", data, pos)
            pos += 8
            if not 0 <= n <= max_len or pos + n > len(data):
                raise ModelLoadError(
                    f"{path}: corrupt or truncated llama2.c tokenizer: token {len(pieces)} claims {n} bytes "
                    f"(max_token_length {max_len}, {len(data) - pos} bytes left)")
            pieces.append(data[pos:pos + n])
            scores.append(score)
            pos += n
        if vocab_size is not None and len(pieces) != vocab_size:
            raise ModelLoadError(f"{path}: llama2.c tokenizer holds {len(pieces)} tokens, expected {vocab_size}")
        if pos != len(data):
            raise ModelLoadError(f"{path}: {len(data) - pos} bytes of trailing data after {len(pieces)} tokens")
        if len(pieces) < 3:
            raise ModelLoadError(f"{path}: llama2.c tokenizer has only {len(pieces)} tokens")
        # run.c hard-codes BOS = 1 and EOS = 2; the pieces are "\n<s>\n" and "\n</s>\n".
        return cls(pieces, scores, max_len, bos_id=1, eos_id=2, source=path)

    def _char_ids(self, chunk: bytes) -> list[int]:
        """One UTF-8 character (or stray byte run) -> its token, else its byte-fallback tokens."""
        tid = self._lookup.get(chunk)
        if tid is not None:
            return [tid]
        out: list[int] = []
        for b in chunk:
            if b not in self._byte_ids:
                raise InputError(f"byte 0x{b:02X} has no token and the vocabulary has no <0x{b:02X}> fallback")
            out.append(self._byte_ids[b])
        return out

    def _initial_ids(self, raw: bytes) -> list[int]:
        """UTF-8 bytes -> per-character tokens (with byte fallback), before any merge.

        Split into UTF-8 characters as run.c does: a non-continuation byte starts a chunk, continuation
        bytes (10xxxxxx) extend it, at most 4 bytes per chunk."""
        tokens: list[int] = []
        lookup, n = self._lookup, len(raw)
        start = 0
        for i in range(n):
            if (raw[i] & 0xC0) != 0x80:
                start = i
            if i + 1 < n and (raw[i + 1] & 0xC0) == 0x80 and i + 1 - start < 4:
                continue
            chunk = raw[start:i + 1]
            tid = lookup.get(chunk)
            if tid is not None:
                tokens.append(tid)
            else:
                tokens += self._char_ids(chunk)
            start = i + 1
        return tokens

    def _merge(self, tokens: list[int]) -> list[int]:
        """run.c's merge loop: repeatedly merge the adjacent pair whose concatenation is a token with the
        highest score (the leftmost pair wins ties; a score must exceed -1e10), until none is left.

        Same result as rescanning the sequence for every merge, in O(n log n): candidate pairs sit in a heap
        keyed by (-score, position of the left token); positions keep their original order in a linked list,
        and an entry whose tokens have changed since it was pushed is dropped when it surfaces."""
        n = len(tokens)
        if n < 2:
            return list(tokens)
        pieces, scores, lookup = self.pieces, self.scores, self._lookup
        toks = list(tokens)
        nxt = list(range(1, n + 1))  # n = no right neighbour
        prv = list(range(-1, n - 1))  # -1 = no left neighbour
        version = [0] * n  # bumped whenever the token at a position changes (or the position dies)
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-score, left, right, versions, merged id)
        for i in range(n - 1):
            tid = lookup.get(pieces[toks[i]] + pieces[toks[i + 1]])
            if tid is not None and scores[tid] > -1e10:
                heap.append((-scores[tid], i, i + 1, 0, 0, tid))
        heapq.heapify(heap)
        while heap:
            _, i, j, vi, vj, tid = heapq.heappop(heap)
            if version[i] != vi or version[j] != vj or nxt[i] != j:
                continue  # stale: one of the two tokens was merged away or replaced
            toks[i] = tid
            version[i] += 1
            version[j] += 1  # position j is gone
            k = nxt[j]
            nxt[i] = k
            if k < n:
                prv[k] = i
            for left in (prv[i], i):
                if left >= 0:
                    r = nxt[left]
                    if r < n:
                        t2 = lookup.get(pieces[toks[left]] + pieces[toks[r]])
                        if t2 is not None and scores[t2] > -1e10:
                            heapq.heappush(heap, (-scores[t2], left, r, version[left], version[r], t2))
        out: list[int] = []
        i = 0
        while i < n:
            out.append(toks[i])
            i = nxt[i]
        return out

    def _can_join(self, left: int, right: int) -> bool:
        """Could a merge ever cross the boundary between adjacent initial tokens `left` and `right`?

        Every token the merges make is a concatenation of adjacent initial pieces, so a merge across the
        boundary needs a vocabulary piece that contains pieces[left] + pieces[right]; without one the two
        sides merge independently (and run.c's global greedy order gives the same result per side)."""
        key = (left, right)
        ok = self._joinable.get(key)
        if ok is None:
            needle = self.pieces[left] + self.pieces[right]
            ok = self._joinable[key] = any(needle in p for p in self.pieces)
        return ok

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Encode exactly as llama2.c run.c's encode(): optional BOS, the " " dummy prefix (for
        non-empty text), per-character tokens with byte fallback, then greedy best-score merges."""
        raw = prompt_bytes(text)
        tokens: list[int] = [self.bos_id] if bos and self.bos_id is not None else []
        if raw:
            tokens += self._char_ids(b" ")
        tokens = self._merge(tokens + self._initial_ids(raw))
        if eos and self.eos_id is not None:
            tokens.append(self.eos_id)
        return tokens

    def iter_encode(self, text: str, bos: bool = True, eos: bool = False) -> Iterator[list[int]]:
        """encode(text, bos, eos) in consecutive chunks, line by line: the chunks concatenated are exactly
        encode()'s ids, and a caller that needs only a prefix can stop early without encoding the rest.

        Lines are cut after each "\n"; a cut is used only where no merge could cross it (see _can_join),
        otherwise the next line is merged together with the pending ones."""
        raw = prompt_bytes(text)
        pending: list[int] = [self.bos_id] if bos and self.bos_id is not None else []
        if raw:
            pending += self._char_ids(b" ")
        pos = 0
        while pos < len(raw):
            cut = raw.find(b"\n", pos)
            end = len(raw) if cut < 0 else cut + 1
            ids = self._initial_ids(raw[pos:end])  # "\n" is ASCII: a cut never splits a character
            pos = end
            if pending and ids and not self._can_join(pending[-1], ids[0]):
                yield self._merge(pending)
                pending = ids
            else:
                pending += ids
        last = self._merge(pending)
        if eos and self.eos_id is not None:
            last.append(self.eos_id)
        if last:
            yield last

    def token_bytes(self, prev_id: int | None, tid: int) -> bytes:
        """The bytes run.c's decode(prev, token) prints for one token (streaming use).

        BOS/EOS give b""; after BOS a leading space is stripped; "<0xXX>" gives the raw byte."""
        if not 0 <= tid < len(self.pieces):
            raise InputError(f"token id {tid} is outside the vocabulary (size {len(self.pieces)})")
        if tid in (self.bos_id, self.eos_id):
            return b""
        piece = self._piece_bytes[tid]
        if prev_id is not None and prev_id == self.bos_id and piece.startswith(b" "):
            piece = piece[1:]
        return piece

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text: BOS/EOS dropped, leading space after BOS stripped, bytes joined, UTF-8."""
        out = bytearray()
        prev: int | None = None
        for tid in ids:
            out += self.token_bytes(prev, int(tid))
            prev = int(tid)
        return out.decode("utf-8", errors="replace")

    def source_files(self) -> list[Path]:
        if self.source is None:
            raise ArtifactError("this llama2.c tokenizer was not read from a file; nothing to save")
        return [self.source]


# ----------------------------------------------------------------------------- Hugging Face

CHAT_TEMPLATE_FILE = "chat_template.jinja"
_HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", CHAT_TEMPLATE_FILE)


def _auto_tokenizer(main: Path, side: list[Path]) -> Any:
    """``transformers.AutoTokenizer`` over exactly ``main`` (a tokenizer.json) and ``side``: the files are copied
    into a private directory first, so nothing else beside them is read, and no remote code is run."""
    import tempfile

    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its notes on tokenizer classes are not the user's business
    if not any(f.name == "tokenizer_config.json" for f in side):
        return PreTrainedTokenizerFast(tokenizer_file=str(main))  # a bare tokenizer.json: no special tokens named
    with tempfile.TemporaryDirectory(prefix="picompile-tok-") as tmp:
        for f in [main, *side]:
            dst = Path(tmp) / ("tokenizer.json" if f == main else f.name)
            if f.suffix == ".json" and f != main:
                dst.write_text(json.dumps(_plain_special_tokens(json.loads(f.read_text(encoding="utf-8")))),
                               encoding="utf-8")
            else:
                shutil.copyfile(f, dst)
        try:
            return AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # transformers raises ValueError/OSError/KeyError/… for a bad config
            raise ModelLoadError(f"{main.parent}: transformers cannot load this tokenizer: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _plain_special_tokens(cfg: Any) -> Any:
    """Special tokens written as objects (``{"content": "</s>", …}``, older transformers) as their strings."""
    if not isinstance(cfg, dict):
        raise ModelLoadError("a tokenizer side file is not a JSON object")
    out = dict(cfg)
    for k, v in cfg.items():
        if k.endswith("_token") and isinstance(v, dict) and isinstance(v.get("content"), str):
            out[k] = v["content"]
    return out


@dataclass
class HFTokenizer:
    """A Hugging Face tokenizer (tokenizer.json and its side files) through ``transformers.AutoTokenizer``.

    encode() adds special tokens exactly as transformers does (``add_special_tokens=True``: BOS only where the
    tokenizer's own config or post-processor says so; SmolLM2 adds none); ``bos=False`` adds none.
    decode() skips special tokens. ``chat_template`` is the tokenizer's own (``chat_template.jinja`` or
    tokenizer_config.json), applied by ``apply_chat_template`` as transformers applies it."""

    tok: Any  # transformers.PreTrainedTokenizerBase
    bos_id: int | None = None
    eos_id: int | None = None
    files: list[Path] = field(default_factory=list)  # tokenizer.json first, then side files found

    @classmethod
    def from_file(cls, path: Path) -> "HFTokenizer":
        """`path` is a tokenizer.json or a directory holding one (side files are read next to it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"Hugging Face tokenizer file {path} does not exist")
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not a valid tokenizer.json: {e}") from None
        side = [path.parent / n for n in _HF_SIDE_FILES if (path.parent / n).is_file()]
        for f in side:
            if f.suffix == ".json":
                try:
                    json.loads(f.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ModelLoadError(f"{f} is not valid JSON: {e}") from None
        try:
            tok = _auto_tokenizer(path, side)
        except ModelLoadError:
            raise
        except Exception as e:  # tokenizers raises a plain Exception on an unknown model
            raise ModelLoadError(f"{path}: not a valid tokenizer.json: {e}") from None
        return cls(tok, _opt_int(tok.bos_token_id), _opt_int(tok.eos_token_id), [path, *side])

    @property
    def vocab_size(self) -> int:
        return int(len(self.tok))

    @property
    def chat_template(self) -> str | None:
        tpl = getattr(self.tok, "chat_template", None)
        return tpl if isinstance(tpl, str) and tpl else None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        prompt_bytes(text)  # undecodable bytes fail here, with one line, not inside the tokenizers library
        return [int(i) for i in self.tok(text, add_special_tokens=bos)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        n = self.vocab_size
        for t in ids:
            if not 0 <= int(t) < n:
                raise InputError(f"token id {t} is outside the vocabulary (size {n})")
        return str(self.tok.decode([int(t) for t in ids], skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            template: str | None = None) -> list[int]:
        """The conversation as token ids, rendered with ``template`` or the tokenizer's own chat template and
        tokenized without further special tokens (what ``transformers``' ``apply_chat_template`` returns)."""
        tpl = template if template is not None else self.chat_template
        if tpl is None:
            raise InputError("this tokenizer has no chat template; give one (--template FILE)")
        try:
            text = self.tok.apply_chat_template(messages, chat_template=tpl, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError, SecurityError, TypeError from the template itself
            raise InputError(f"the chat template failed: {type(e).__name__}: {e}") from None
        return self.encode(str(text), bos=False)

    def special_ids(self) -> set[int]:
        return {int(i) for i in getattr(self.tok, "all_special_ids", [])}

    def source_files(self) -> list[Path]:
        if not self.files:
            raise ArtifactError("this Hugging Face tokenizer was not read from a file; nothing to save")
        return list(self.files)


def _opt_int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) else None


def render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> str:
    """``template`` (Jinja, a Hugging Face chat template) rendered over ``messages`` in a sandbox (no attribute
    access beyond jinja2's safe set, no imports, no file access) — for tokenizers without transformers."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise InputError(f"the chat template refused the conversation: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:
        raise InputError(f"the chat template failed: {type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------- load / save

TOKENIZER_KINDS = ("llama2c", "hf")


def load_tokenizer(kind: str, path: Path) -> Tokenizer:
    """Load a tokenizer of `kind` ("llama2c": a tokenizer.bin; "hf": a tokenizer.json or its dir)."""
    if kind == "llama2c":
        return Llama2cTokenizer.from_file(Path(path))
    if kind == "hf":
        return HFTokenizer.from_file(Path(path))
    raise ModelLoadError(f"unknown tokenizer kind {kind!r}; known: {', '.join(TOKENIZER_KINDS)}")


def _kind_of(tok: Tokenizer) -> str:
    if isinstance(tok, Llama2cTokenizer):
        return "llama2c"
    if isinstance(tok, HFTokenizer):
        return "hf"
    raise ArtifactError(f"cannot save a tokenizer of type {type(tok).__name__}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_tokenizer(tok: Tokenizer, dest_dir: Path) -> dict[str, Any]:
    """Copy the tokenizer's source file(s) into `dest_dir`/tokenizer/ and return its manifest entry:
    {"kind": ..., "files": [paths relative to dest_dir, main file first], "sha256": {file: hex}}."""
    kind = _kind_of(tok)
    sources = tok.source_files()  # type: ignore[attr-defined]
    out_dir = Path(dest_dir) / TOKENIZER_SUBDIR
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    digests: dict[str, str] = {}
    for src in sources:
        dst = out_dir / src.name
        if not src.is_file():
            raise ModelLoadError(f"tokenizer file {src} disappeared before it could be saved")
        if not dst.exists() or not dst.samefile(src):
            shutil.copyfile(src, dst)
        rel = f"{TOKENIZER_SUBDIR}/{src.name}"
        files.append(rel)
        digests[rel] = _sha256(dst)
    entry: dict[str, Any] = {"kind": kind, "files": files, "sha256": digests}
    tpl = f"{TOKENIZER_SUBDIR}/{CHAT_TEMPLATE_FILE}"
    if kind == "hf" and tpl not in files and getattr(tok, "chat_template", None):
        (out_dir / CHAT_TEMPLATE_FILE).write_text(tok.chat_template, encoding="utf-8")  # type: ignore[attr-defined]
        files.append(tpl)  # a template kept inside tokenizer_config.json: carried as the file transformers writes
        digests[tpl] = _sha256(out_dir / CHAT_TEMPLATE_FILE)
    if tpl in files:
        entry["chat_template"] = tpl  # listed in the manifest: this artifact can chat
    return entry


def load_tokenizer_entry(entry: dict[str, Any], artifact_dir: Path) -> Tokenizer:
    """Load the tokenizer a manifest entry (from save_tokenizer) describes, checking its sha256s.

    Every file it reads lies inside the artifact (picompile.formats.paths) and has its sha256 in the entry,
    checked before the tokenizer reads it — the main file and any side file beside it alike.
    """
    from picompile.formats.paths import inside

    try:
        kind, files = entry["kind"], list(entry["files"])
        digests = dict(entry.get("sha256") or {})
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(f"bad tokenizer manifest entry {str(entry)[:80]!r}: needs 'kind' and 'files'") from None
    if not files:
        raise ArtifactError("tokenizer manifest entry lists no files")
    root = Path(artifact_dir)
    main = inside(root, files[0], "tokenizer.files[0]")
    side = [f"{Path(files[0]).parent.as_posix()}/{n}" for n in _HF_SIDE_FILES] if kind == "hf" else []
    present = [rel for rel in side if (root / rel).exists() or (root / rel).is_symlink()]
    for rel in dict.fromkeys([*files, *present]):
        f = inside(root, rel, "tokenizer.files")
        if rel not in digests:
            raise ArtifactError(f"tokenizer file {rel} has no sha256 in the manifest's tokenizer entry")
        if not f.is_file():
            raise ArtifactError(f"tokenizer file {f} named in the manifest is missing")
        if _sha256(f) != digests[rel]:
            raise ArtifactError(f"tokenizer file {f} fails its sha256 check")
    return load_tokenizer(kind, main)


def prompt_bytes(text: str) -> bytes:
    """``text`` as UTF-8; a prompt that is not valid Unicode (undecodable bytes on the command line) is an InputError."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("utf-8", "surrogateescape")
        raise InputError(f"the prompt is not valid UTF-8 (bytes {bad!r} at character {e.start}); give UTF-8 text") from None


__all__ = [
    "CHAT_TEMPLATE_FILE",
    "HFTokenizer",
    "Llama2cTokenizer",
    "TOKENIZER_KINDS",
    "Tokenizer",
    "load_tokenizer",
    "load_tokenizer_entry",
    "render_chat",
    "save_tokenizer",
]
