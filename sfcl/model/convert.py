"""Convert a model source (a GGUF file or a HF folder) into ``sfcl.model.loader``'s cache format, in the
process that runs ``python -m sfcl.model.convert SOURCE CACHE``: ``load_model`` starts it for a first load
with a cache directory, so that what reading the source leaves behind (transformers' GGUF modules,
the dequantised float32 copy) ends with the child rather than staying in the server (loader docstring).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from sfcl.model import loader
from sfcl.model.loader import CONVERT_ERROR, ModelLoadError, ModelSource

log = logging.getLogger("sfcl.model")


def convert_to_cache(src: ModelSource, cache: Path) -> None:
    """Read ``src`` with transformers and write what ``load_model`` reads back into ``cache``: the
    float32 weights (``weights.safetensors``, with the RoPE inverse frequencies as ``__inv_freq__``;
    a tied ``lm_head`` left out), the tokenizer, ``meta.json`` (architecture, RoPE attention scaling,
    source path) and ``done``. Written into a folder of its own beside ``cache`` and renamed into
    place, so that a process loading ``cache`` never reads files another conversion is still writing
    (two servers starting together on one cache). Where ``cache`` already holds a complete conversion
    (another process's), this one is dropped; a ``cache`` without ``done`` (a conversion cut short by
    older code) is replaced, and older conversions of the same source path are removed
    (``_drop_superseded``). Raises ModelLoadError (unreadable or unsupported model) or OSError (the
    cache cannot be written)."""
    from safetensors.torch import save_file

    _, args, tok, state, (inv_freq, scaling) = loader.read_checkpoint(src)
    cache.parent.mkdir(parents=True, exist_ok=True)
    _drop_orphans(cache)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.{os.getpid()}.", dir=cache.parent))
    os.chmod(tmp, 0o755)  # as a plain mkdir would leave it (mkdtemp's folder is private)
    try:
        keep = {k: v for k, v in state.items() if not (args.tie_word_embeddings and k == "lm_head.weight")}
        save_file({k: v.float().contiguous() for k, v in keep.items()} | {"__inv_freq__": inv_freq.float()},
                  tmp / "weights.safetensors")
        tok.save_pretrained(tmp)
        (tmp / "meta.json").write_text(json.dumps({"args": {f: getattr(args, f) for f in args.__slots__},
                                                   "attention_scaling": scaling, "source": str(src.path)}))
        (tmp / "done").write_text("ok")
        if cache.is_dir() and not (cache / "done").is_file():
            shutil.rmtree(cache, ignore_errors=True)
        try:
            os.rename(tmp, cache)  # atomic; fails when another conversion got there first
        except OSError:
            if not (cache / "done").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename
    _drop_superseded(cache, src)


def _drop_superseded(cache: Path, src: ModelSource) -> None:
    """Remove the other conversions of the same source path (``meta.json``'s ``source``): the
    file or folder changed since they were made (``loader._cache_key``), and each is ~0.5 GB for
    SmolLM2-135M. A process that loaded one already holds its weights; one reading it at this
    moment would fail to load (a start racing a change of the model file)."""
    here = src.path.resolve()
    for meta in cache.parent.glob("*/meta.json"):
        d = meta.parent
        if d == cache:
            continue
        try:
            if Path(json.loads(meta.read_text())["source"]).resolve() == here:
                shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: not ours to judge
            continue


def _drop_orphans(cache: Path) -> None:
    """Remove the temporary folders of conversions into ``cache`` whose process is gone (killed while
    writing: ~0.5 GB each for SmolLM2-135M); a live process's folder is left alone."""
    for d in cache.parent.glob(f".{cache.name}.*"):
        pid = d.name.split(".")[2] if d.name.count(".") >= 3 else ""
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _convert_main(argv: list[str]) -> int:
    """``python -m sfcl.model.convert SOURCE CACHE``: ``convert_to_cache`` for ``loader._convert_in_child``.
    Exit 0 done, 2 the model cannot be read (the message on stdout after ``CONVERT_ERROR``), 3 the
    cache cannot be written."""
    source, cache = argv
    try:
        convert_to_cache(loader.resolve_model(source), Path(cache))
    except ModelLoadError as e:
        print(CONVERT_ERROR + " ".join(str(e).split()), flush=True)
        return 2
    except OSError as e:  # a read-only cache is not fatal: the parent converts in process
        log.warning("could not cache converted weights in %s: %s", cache, e)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(_convert_main(sys.argv[1:]))
