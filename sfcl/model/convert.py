"""Convert a model source (a GGUF file or a HF folder) into ``sfcl.model.loader``'s cache format, in the
process that runs ``python -m sfcl.model.convert SOURCE CACHE``: ``load_model`` starts it for a first load
with a cache directory, so that what reading the source leaves behind (transformers' GGUF modules,
the dequantised float32 copy) ends with the child rather than staying in the server (loader docstring).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from sfcl.model.loader import ModelLoadError, ModelSource, read_checkpoint, resolve_model

log = logging.getLogger("sfcl.model")


def convert_to_cache(src: ModelSource, cache: Path) -> None:
    """Read ``src`` with transformers and write what ``load_model`` reads back into ``cache``: the
    float32 weights (``weights.safetensors``, with the RoPE inverse frequencies as ``__inv_freq__``;
    a tied ``lm_head`` left out), the tokenizer, ``meta.json`` (architecture, RoPE attention scaling,
    source path) and, last, ``done``. Raises ModelLoadError (unreadable or unsupported model) or
    OSError (the cache cannot be written)."""
    from safetensors.torch import save_file

    _, args, tok, state, (inv_freq, scaling) = read_checkpoint(src)
    cache.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in state.items() if not (args.tie_word_embeddings and k == "lm_head.weight")}
    save_file({k: v.float().contiguous() for k, v in keep.items()} | {"__inv_freq__": inv_freq.float()},
              cache / "weights.safetensors")
    tok.save_pretrained(cache)
    (cache / "meta.json").write_text(json.dumps({"args": {f: getattr(args, f) for f in args.__slots__},
                                                 "attention_scaling": scaling, "source": str(src.path)}))
    (cache / "done").write_text("ok")


CONVERT_ERROR = "sfcl-convert-error: "  # the child's stdout line that carries a ModelLoadError's message


def _convert_main(argv: list[str]) -> int:
    """``python -m sfcl.model.convert SOURCE CACHE``: ``convert_to_cache`` for ``loader._convert_in_child``.
    Exit 0 done, 2 the model cannot be read (the message on stdout after ``CONVERT_ERROR``), 3 the
    cache cannot be written."""
    source, cache = argv
    try:
        convert_to_cache(resolve_model(source), Path(cache))
    except ModelLoadError as e:
        print(CONVERT_ERROR + " ".join(str(e).split()), flush=True)
        return 2
    except OSError as e:  # a read-only cache is not fatal: the parent converts in process
        log.warning("could not cache converted weights in %s: %s", cache, e)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(_convert_main(sys.argv[1:]))
