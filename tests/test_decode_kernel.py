"""SFCL's fused CPU decode-attention kernel (``sfcl.model.decode_kernel``, ``csrc/decode_attention.cpp``)
against ``Attention.decode_attn``'s torch path, and inside the engine."""

from __future__ import annotations

import pytest
import torch

from sfcl.model import decode_kernel


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"the kernel could not be built here: {decode_kernel.why_unavailable()}")
    return decode_kernel


def _cache_with_history(a, dtype, rows: int, max_len: int, S: int, gen):
    from sfcl.model.kv_cache import KVCache

    kv = KVCache(a, rows, max_len, dtype)
    kv.ensure_initialized(rows, max_len)
    nkv, hd = a.n_kv_heads, a.head_dim
    for pos in range(S - 1):
        kv.write_decode(0, torch.arange(rows), torch.full((rows,), pos),
                        torch.randn(rows, nkv, hd, generator=gen).to(dtype), torch.randn(rows, nkv, hd, generator=gen).to(dtype))
    return kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row0, lens", [(0, [37]), (0, [39, 12, 26, 1]), (2, [5, 40])])  # every length mod 4
def test_fused_decode_attention_matches_the_torch_path(kernel, lm, dtype, row0, lens):
    """Same outputs, weights and cache writes as the eager operators: rows at an offset in the
    cache, each attending to its own length (down to a single position), probs zero past it."""
    from sfcl.model.llama import Attention, AttnBatch

    a = lm.args
    attn = Attention(a)
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    gen = torch.Generator().manual_seed(0)
    B, S = len(lens), max(lens)
    lens_t = torch.tensor(lens)
    q = torch.randn(B, nh, hd, generator=gen).to(dtype)
    k, v = (torch.randn(B, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    mask = (torch.arange(S)[None, :] < lens_t[:, None]).view(B, 1, 1, S)
    out = {}
    for fused in (False, True):
        kv = _cache_with_history(a, dtype, row0 + B + 1, 64, S, torch.Generator().manual_seed(1))
        kv.fused_decode = fused
        batch = AttnBatch(is_prefill=False, slots=torch.arange(row0, row0 + B), positions=lens_t - 1, kv_len=S,
                          mask=mask, slot_range=(row0, row0 + B))
        o, p = attn.decode_attn(q, k, v, batch, kv, 0, True)
        out[fused] = (o, p, kv.k[0].clone(), kv.v[0].clone())
    (o0, p0, k0, v0), (o1, p1, k1, v1) = out[False], out[True]
    assert o1.dtype == dtype and o1.shape == (B, nh * hd) and p1.shape == (B, nh, 1, S) and p1.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(o1.float(), o0.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(p1, p0, atol=1e-5, rtol=1e-4)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)  # the new K/V written at each row's position
    for b, n in enumerate(lens):
        assert (p1[b, :, 0, n:] == 0).all() and torch.allclose(p1[b, :, 0, :n].sum(-1), torch.ones(nh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd, nkv, g", [(64, 2, 1), (64, 1, 4), (64, 2, 6), (128, 2, 3), (128, 1, 8)])
def test_fused_decode_attention_head_shapes_against_float64(kernel, dtype, hd, nkv, g):
    """Every head shape the kernel takes (its specialised paths for head_dim 64 and 1-4 query heads
    per KV head, and the generic one) against attention computed in float64 from the same inputs."""
    gen = torch.Generator().manual_seed(3)
    B, L = 3, 80
    pos = torch.tensor([70, 2, 33])
    S = int(pos.max()) + 1
    kc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    vc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    q = torch.randn(B, nkv * g, hd, generator=gen).to(dtype)
    kn, vn = (torch.randn(B, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    ref_k, ref_v = kc.double().clone(), vc.double().clone()
    ref_k[torch.arange(B), :, pos] = kn.double()
    ref_v[torch.arange(B), :, pos] = vn.double()
    o, p = kernel.decode_attention(q, kc, vc, kn, vn, pos, 0, S, hd ** -0.5, True)
    for b in range(B):
        n = int(pos[b]) + 1
        qb = q[b].double().view(nkv, g, hd)
        w = (torch.einsum("hgd,hsd->hgs", qb, ref_k[b, :, :n]) * hd ** -0.5).softmax(-1)  # (nkv, g, n)
        ob = torch.einsum("hgs,hsd->hgd", w, ref_v[b, :, :n]).reshape(-1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(o[b].double(), ob, atol=tol, rtol=tol)
        torch.testing.assert_close(p[b, :, 0, :n].double(), w.reshape(nkv * g, n), atol=1e-5, rtol=1e-4)
        assert (p[b, :, 0, n:] == 0).all()
    assert torch.equal(kc[torch.arange(B), :, pos], kn) and torch.equal(vc[torch.arange(B), :, pos], vn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_far_below_the_rows_max_weighs_nothing(kernel, dtype):
    """A cached key whose scaled score is ~800 below the others' gets weight 0, as from torch's
    softmax: the output equals the one with its value set to 0, bit for bit (the exp's clamp at -87
    once gave it ~1.6e-38, which 1e37 in its value made visible)."""
    gen = torch.Generator().manual_seed(5)
    B, L, hd, nkv, g = 2, 40, 64, 2, 3
    pos = torch.tensor([30, 20])
    kc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    vc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    q = torch.ones(B, nkv * g, hd).to(dtype)
    kc[:, :, 5] = -100.0  # score of position 5: 0.125 * 64 * -100 = -800
    kn, vn = (torch.randn(B, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    vc[:, :, 5] = 0.0
    zero, _ = kernel.decode_attention(q, kc.clone(), vc.clone(), kn, vn, pos, 0, int(pos.max()) + 1, 0.125, True)
    vc[:, :, 5] = 1e37
    got, _ = kernel.decode_attention(q, kc.clone(), vc.clone(), kn, vn, pos, 0, int(pos.max()) + 1, 0.125, True)
    assert torch.equal(got, zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd, nkv, g", [(64, 2, 1), (64, 1, 4), (128, 1, 8)])
def test_a_nan_key_makes_the_heads_that_read_it_nan(kernel, dtype, hd, nkv, g):
    """A NaN in one cached key: the query heads of its KV head come out NaN in the rows that attend
    to it, as torch's softmax gives (the AVX-512 softmax once clamped it to a weight of e^-87,
    unlike the scalar one); the other heads and rows stay finite."""
    gen = torch.Generator().manual_seed(4)
    B, L = 2, 40
    pos = torch.tensor([30, 3])
    kc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    vc = torch.randn(B, nkv, L, hd, generator=gen).to(dtype)
    kc[:, 0, 5, 0] = float("nan")  # position 5 of KV head 0: row 0 attends to it, row 1 (positions 0-3) does not
    q = torch.randn(B, nkv * g, hd, generator=gen).to(dtype)
    kn, vn = (torch.randn(B, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    o, _ = kernel.decode_attention(q, kc, vc, kn, vn, pos, 0, int(pos.max()) + 1, hd ** -0.5, True)
    nan = o.view(B, nkv, g, hd).isnan().any(-1)  # (B, nkv, g)
    assert nan[0, 0].all() and not nan[0, 1:].any() and not nan[1].any()


def test_fused_decode_attention_without_probs_and_strided_inputs(kernel, lm):
    """q, k, v as the projections give them (views into one qkv row, strided across heads) and no
    weights asked for: the output equals that of contiguous copies."""
    a = lm.args
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    gen = torch.Generator().manual_seed(2)
    B, S = 3, 20
    kv = _cache_with_history(a, torch.float32, B + 1, 32, S, gen)
    qkv = torch.randn(B, (nh + 2 * nkv) * hd, generator=gen)
    q = qkv[:, :nh * hd].view(B, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].view(B, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].view(B, nkv, hd)
    pos = torch.tensor([19, 10, 4])
    kc, vc = kv.k[0].clone(), kv.v[0].clone()
    o, p = kernel.decode_attention(q, kv.k[0], kv.v[0], k, v, pos, 0, S, hd ** -0.5, False)
    o2, _ = kernel.decode_attention(q.contiguous(), kc, vc, k.contiguous(), v.contiguous(), pos, 0, S, hd ** -0.5, True)
    assert p is None
    torch.testing.assert_close(o, o2, atol=0, rtol=0)


def test_fused_decode_attention_rejects_what_it_does_not_take(kernel, lm):
    a = lm.args
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    kc = torch.zeros(3, nkv, 16, hd)
    q, k = torch.zeros(2, nh, hd), torch.zeros(2, nkv, hd)
    pos = torch.tensor([3, 4])
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.decode_attention(q.bfloat16(), kc, kc.clone(), k, k, pos, 0, 5, 0.125, False)
    with pytest.raises(RuntimeError, match="positions"):
        kernel.decode_attention(q, kc, kc.clone(), k, k, torch.tensor([3, 5]), 0, 5, 0.125, False)
    with pytest.raises(RuntimeError, match="rows out of range"):
        kernel.decode_attention(q, kc, kc.clone(), k, k, pos, 2, 5, 0.125, False)
    with pytest.raises(RuntimeError, match="k_new, v_new"):
        kernel.decode_attention(q, kc, kc.clone(), k[..., :32], k[..., :32], pos, 0, 5, 0.125, False)
    with pytest.raises(RuntimeError, match=r"S must lie in \[1, max_len\]"):
        kernel.decode_attention(q, kc, kc.clone(), k, k, pos, 0, 17, 0.125, False)
    with pytest.raises(RuntimeError, match="rows out of range"):  # row0 + B would overflow int64
        kernel.decode_attention(q, kc, kc.clone(), k, k, pos, 2 ** 63 - 1, 5, 0.125, False)
    with pytest.raises(RuntimeError, match="head shapes"):  # no KV heads: no division by zero
        kernel.decode_attention(q, torch.zeros(3, 0, 16, hd), torch.zeros(3, 0, 16, hd), k[:, :0], k[:, :0], pos, 0, 5,
                                0.125, False)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.decode_attention(q, kc, kc.bfloat16(), k, k, pos, 0, 5, 0.125, False)
    o, p = kernel.decode_attention(q[:0], kc, kc.clone(), k[:0], k[:0], pos[:0], 0, 5, 0.125, True)  # no rows
    assert o.shape == (0, nh * hd) and p.shape == (0, nh, 1, 5)


def test_supports_only_the_16_and_32_bit_cpu_cache(lm):
    from sfcl.model.kv_cache import KVCache

    assert decode_kernel.supports(lm.args, KVCache(lm.args, 2, 32, torch.bfloat16))
    assert not decode_kernel.supports(lm.args, KVCache(lm.args, 2, 32, torch.bfloat16, kv_dtype="int8"))


@pytest.mark.parametrize("mode, attention, layers", [("auto", True, True), ("attention", True, False),
                                                      ("torch", False, False)])
def test_enable_sets_the_flags_each_mode_names(kernel, lm, mode, attention, layers):
    from sfcl.model.kv_cache import KVCache

    kv = KVCache(lm.args, 2, 32, torch.bfloat16)
    why = decode_kernel.enable(kv, lm.args, mode, verbose=False)
    assert (kv.fused_decode, kv.fused_layers) == (attention, layers) and (why == "") == attention
    int8 = KVCache(lm.args, 2, 32, torch.bfloat16, kv_dtype="int8")
    assert "INT8" in decode_kernel.enable(int8, lm.args, mode, verbose=False) or mode == "torch"
    assert not int8.fused_decode and not int8.fused_layers


def test_engine_greedy_answers_equal_with_and_without_the_kernel(kernel, lm_fp32):
    """The engine (batched decode, rows finishing at different steps, the snapshot layer's weights)
    gives the same greedy tokens with the fused kernel as with torch's operators, float32."""
    from sfcl.config import EngineConfig
    from sfcl.engine.engine import run_to_completion
    from sfcl.engine.events import TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import make_llm_engine

    prompts = ["The term of this Agreement shall be", "Confidential Information means", "1, 2, 3, 4,",
               "The Receiving Party shall not disclose"]
    ids = [lm_fp32.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    texts = {}
    for mode in ("torch", "auto"):
        eng = make_llm_engine(lm_fp32, None, EngineConfig(max_num_seqs=4, max_model_len=256, attention_kernel=mode))
        assert eng.runner.kv.fused_decode == (mode == "auto")
        evs = run_to_completion(eng, [(p, SamplingParams(max_tokens=8 + 6 * i, temperature=0.0))
                                      for i, p in enumerate(ids)])
        texts[mode] = ["".join(e.text for e in ev if isinstance(e, TextDelta)) for ev in evs]
    assert all(texts["torch"]) and texts["auto"] == texts["torch"]


def _load_in_subprocess(tmp_path, env_extra: dict, code_prefix: str = ""):
    import os
    import subprocess
    import sys

    env = {**os.environ, "SFCL_KERNEL_CACHE": str(tmp_path / "kernels"), **env_extra}
    code = (code_prefix + "import sfcl.model.decode_kernel as d\n"
            "ok = d.load()\nprint('LOADED' if ok else 'NOT LOADED', d._state.get('why'))\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_kernel_can_be_turned_off_by_environment(tmp_path):
    r = _load_in_subprocess(tmp_path, {"SFCL_DECODE_KERNEL": "0"})
    assert r.returncode == 0 and "NOT LOADED SFCL_DECODE_KERNEL=0" in r.stdout
    assert not (tmp_path / "kernels").exists()  # nothing was built


def test_failed_build_falls_back_with_one_line_on_stderr(tmp_path):
    """A build that fails (here: a compiler flag g++ rejects) leaves attention on torch's
    operators and says why, instead of failing the server's start."""
    r = _load_in_subprocess(tmp_path, {}, "import sfcl.model.decode_kernel as d\nd.CFLAGS = ['-fno-such-flag-sfcl']\n")
    assert r.returncode == 0 and "NOT LOADED" in r.stdout
    assert "[ENGINE] compiling SFCL's kernels" in r.stderr  # a fresh cache: says it compiles
    assert "[ENGINE] fused decode kernels unavailable" in r.stderr and "using torch's operators" in r.stderr


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory):
    """One build of the kernels into an empty cache, in a subprocess (~1 min on 2 cores), shared by the
    tests below: each copies the cache it left and goes on from there. (tmp dir, its CompletedProcess)"""
    root = tmp_path_factory.mktemp("fresh-build")
    return root, _load_in_subprocess(root, {})


def _copy_of(fresh_build, tmp_path):
    import shutil

    root, first = fresh_build
    assert first.returncode == 0 and first.stdout.startswith("LOADED"), first.stdout + first.stderr
    assert "[ENGINE] compiling" in first.stderr  # it was built, not found
    shutil.copytree(root / "kernels", tmp_path / "kernels")
    return tmp_path / "kernels"


def test_a_finished_build_loads_without_the_builder_or_its_lock(fresh_build, tmp_path):
    """Once built, later starts load the library as it is: a stale ``lock`` from a killed build
    (on which torch's builder waits forever) and a leftover build folder change nothing, and the
    builder is not run at all (so a read-only cache or another ninja on PATH does not matter)."""
    kernels = _copy_of(fresh_build, tmp_path)
    [built] = [d for d in kernels.iterdir() if ".tmp-" not in d.name]
    assert sorted(f.name for f in built.iterdir()) == [built.name + ".so", built.name + ".so.sha256"]  # build folder cleaned up
    (built / "lock").write_text("")  # what a killed torch build leaves behind
    (kernels / (built.name + ".tmp-1-x")).mkdir()
    (kernels / (built.name + ".tmp-1-x") / "lock").write_text("")
    second = _load_in_subprocess(tmp_path, {}, "import torch.utils.cpp_extension as c\n"
                                               "def no(*a, **k): raise AssertionError('builder ran')\n"
                                               "c.load = no\n")
    assert second.returncode == 0 and second.stdout.startswith("LOADED"), second.stdout + second.stderr
    assert "compiling" not in second.stderr


def test_a_truncated_library_is_rebuilt_not_loaded(fresh_build, tmp_path):
    """A cached library that is not the file its build wrote (here cut to 4 KiB, as a full disk or a
    killed copy leaves it) is rebuilt: loading it could kill the process with SIGBUS (found by a
    break-it pass), which no fallback could catch."""
    kernels = _copy_of(fresh_build, tmp_path)
    (so,) = kernels.glob("*/*.so")
    assert so.with_name(so.name + ".sha256").exists()
    so.write_bytes(so.read_bytes()[:4096])
    again = _load_in_subprocess(tmp_path, {})
    assert again.returncode == 0 and "LOADED" in again.stdout and "NOT LOADED" not in again.stdout
    assert "[ENGINE] compiling" in again.stderr  # rebuilt
    assert so.stat().st_size > 4096


def test_kernel_march_comes_from_the_environment():
    """``SFCL_KERNEL_MARCH`` sets the kernels' ``-march=`` (default native) and is part of the build's
    name, so a library built for one target is never loaded for another."""
    import os
    import subprocess
    import sys

    code = "import sfcl.model.decode_kernel as d\nprint(' '.join(d.CFLAGS))\nprint(d.build_name())\n"

    def run(march):
        env = {k: v for k, v in os.environ.items() if k != "SFCL_KERNEL_MARCH"}
        if march is not None:
            env["SFCL_KERNEL_MARCH"] = march
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.split("\n")[:2]

    (flags0, name0), (flags1, name1), (flags2, name2) = run(None), run("x86-64-v3"), run("")
    assert "-march=native" in flags0.split() and "-march=x86-64-v3" in flags1.split()
    assert (flags2, name2) == (flags0, name0)  # empty: the default
    assert name1 != name0


def test_a_kernel_march_that_is_not_one_word_is_refused_before_building(tmp_path):
    """``SFCL_KERNEL_MARCH`` is one ``-march=`` value: anything that would add compiler flags is
    refused with a line saying so, and nothing is built (break-it pass: "x86-64 -DFOO" built)."""
    r = _load_in_subprocess(tmp_path, {"SFCL_KERNEL_MARCH": "x86-64 -DFOO"})
    assert r.returncode == 0 and "NOT LOADED" in r.stdout and "is not a -march= value" in r.stdout
    assert "using torch's operators" in r.stderr and not (tmp_path / "kernels").exists()


def test_the_kernels_split_work_over_torchs_threads(kernel):
    """The library is built with OpenMP, so at::parallel_for uses torch's intra-op threads (built
    without it, every kernel ran on one thread and this returned 1); and it shares torch's OpenMP
    runtime: the only ``libgomp.so.1`` mapped is torch's (other wheels may bring renamed copies of
    their own, e.g. scikit-learn's ``libgomp-<hash>.so``, which nothing of ours links)."""
    import os
    import re

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernel.module().parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert kernel.module().parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)
    with open("/proc/self/maps") as f:
        gomp = {m for m in re.findall(r"\S*/libgomp\.so\.1", f.read())}
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    assert gomp and {os.path.dirname(os.path.realpath(m)) for m in gomp} == {torch_lib}, gomp
