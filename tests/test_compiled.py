"""The compiled decode step (``sfcl.model.compiled``) gives the eager engine's output."""

import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import Finished, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.model.compiled import CompiledDecode

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nda_prompt(lm):
    from conftest import contractnli_docs

    return lm.tokenizer.encode(contractnli_docs(1)[0].text[:3000])


def _texts(events):
    return ["".join(e.text for e in ev if isinstance(e, TextDelta)) for ev in events]


def test_compiled_decode_matches_eager_greedy_fp32(shallow_model, nda_prompt):
    """fp32, several sequences joining and leaving (B = 1 and B >= 2 graphs, lengths crossing
    the zero-ahead boundary): the compiled engine emits the eager engine's greedy tokens
    (the bundled model cut to a few blocks, ``shallow_model``: compile time grows with depth)."""
    from sfcl.engine_stack import make_llm_engine

    fp32 = shallow_model()
    prompts = [(nda_prompt[:n], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
               for n, m in ((240, 24), (17, 40), (90, 8), (250, 12))]
    eager = make_llm_engine(fp32, None, EngineConfig(max_num_seqs=4, max_model_len=512))
    comp = make_llm_engine(fp32, None, EngineConfig(max_num_seqs=4, max_model_len=512, compile=True))
    assert comp.runner.compiled_decode is not None and comp.runner.compiled_decode.compile_s > 0
    assert comp.runner.compiled_decode.uncompiled == []  # every warm-up batch compiled, none runs eager
    a, b = run_to_completion(eager, prompts), run_to_completion(comp, prompts)
    assert comp.runner.compiled_decode.calls > 40  # the decode steps really ran compiled
    assert _texts(a) == _texts(b)
    assert all(isinstance(ev[-1], Finished) for ev in b)
    assert [ev[-1].completion_tokens for ev in b] == [24, 40, 8, 12]


def test_compile_refuses_int8_kv():
    with pytest.raises(ValueError, match="int8"):
        EngineConfig(kv_cache_dtype="int8", compile=True)


def test_compiled_decode_refuses_prefill_steps(lm):
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import ChunkSpec, StepBatch

    kv = KVCache(lm.args, 2, 64, torch.bfloat16)
    cd = CompiledDecode(lm.model, kv)
    step = StepBatch(positions=torch.arange(3), decode=None, chunks=[ChunkSpec(0, 0, 0, 3)],
                     sample_index=torch.tensor([2]))
    with pytest.raises(ValueError, match="decode-only"):
        cd(torch.zeros(1, 3, dtype=torch.long), step, 3)
    with pytest.raises(ValueError, match="INT8"):
        CompiledDecode(lm.model, KVCache(lm.args, 2, 64, torch.bfloat16, kv_dtype="int8"))


def test_compiled_decode_with_int4_weights_matches_eager(shallow_model, nda_prompt):
    """--compile with --weight-quant int4 (fp32 activations, so both paths round alike): 8
    sequences join and leave, so decode batches cross the packed/dense kernel cut (B <= 6 and
    B = 7, 8); the compiled engine emits the eager engine's greedy tokens, with no graph compiled
    after warm-up."""
    from sfcl.engine_stack import make_llm_engine
    from sfcl.model.quant import quantize_weights

    lm4 = shallow_model()
    quantize_weights(lm4.model, "int4")
    prompts = [(nda_prompt[:n], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
               for n, m in ((200, 30), (17, 12), (90, 20), (33, 6), (120, 26), (60, 16), (75, 9), (45, 22))]
    eager = make_llm_engine(lm4, None, EngineConfig(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64))
    comp = make_llm_engine(lm4, None, EngineConfig(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64,
                                                   compile=True))
    cd = comp.runner.compiled_decode
    assert cd.batch_buckets() == [1, 2, 7, 8]  # 7: the first batch past the int4 kernel cut (max_rows 6)
    assert cd.uncompiled == []
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    a, b = run_to_completion(eager, prompts), run_to_completion(comp, prompts)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # nothing compiled while serving
    assert cd.calls > 20  # decode-only steps (others carry prompt chunks and run eager)
    assert _texts(a) == _texts(b)
    assert [ev[-1].completion_tokens for ev in b] == [30, 12, 20, 6, 26, 16, 9, 22]


def test_compiled_decodes_in_one_process_each_compile_their_graphs(shallow_model):
    """Five compiled decode steps alive in one process, two graphs each (batch 1, batches >= 2;
    the full batch of 4 reuses the second): each warm-up compiles its own. torch.compile traces
    every one through one wrapper of torch's, and before ``isolate_recompiles`` the ninth graph hit
    Dynamo's recompile limit (8): the fifth step compiled nothing and its decode ran eager while
    counting as compiled (``uncompiled`` was [1, 2, 4])."""
    from sfcl.model.kv_cache import KVCache

    fp32 = shallow_model()
    alive = []
    for _ in range(5):
        cd = CompiledDecode(fp32.model, KVCache(fp32.args, 4, 64, torch.float32))
        assert cd.batch_buckets() == [1, 2, 4]
        cd.warmup(1)
        assert cd.uncompiled == []
        alive.append(cd)


def test_decode_batches_torch_compile_gives_up_on_are_named(shallow_model, capsys):
    """With Dynamo's recompile limit at 1, the warm-up compiles batch 1 only: batches 2 and 3 run
    eager and the engine says so on stderr rather than claiming a compiled decode step."""
    from sfcl.engine_stack import make_llm_engine

    with torch._dynamo.config.patch(recompile_limit=1):
        comp = make_llm_engine(shallow_model(), None, EngineConfig(max_num_seqs=3, max_model_len=256, compile=True))
    assert comp.runner.compiled_decode.uncompiled == [2, 3]
    err = capsys.readouterr().err
    assert "torch.compile compiled no graph for decode batches of [2, 3] rows" in err
    # the compiled step replaces SFCL's fused decode kernels, slower where measured: said wherever they loaded
    assert ("note: the compiled step replaces SFCL's fused decode kernels" in err) == comp.runner.kv.fused_layers


def test_served_avx2_weights_compile_in_one_graph_per_batch(shallow_model, nda_prompt, monkeypatch):
    """The float32 format of AVX2 CPUs (int4 blocks, an int8 lm_head for 1-3 rows and FBGEMM fp16 weights
    above) as ``--compile`` serves it (``served_weights(traceable=True)``): the lm_head's dense path is a
    plain float32 copy, so the warm-up compiles batches 1, 2 and 4 (the lm_head's cut) without a graph
    break and 4 streams recompile nothing. With FBGEMM's fp16 copy Dynamo broke the graph there (its packed
    weight is a ScriptObject) and the warm-up says so: a tester saw the first batch of 4 recompile while
    serving, a 15 s stall."""
    from sfcl.engine_stack import served_weights, make_llm_engine
    from sfcl.model import hardware
    from sfcl.model.hardware import WeightFormat
    from sfcl.model.quant import Fp16Linear, fp16_gemm_available

    if not fp16_gemm_available():
        pytest.skip("FBGEMM fp16 GEMM not in this torch build")
    fake = {"fp32_fbgemm": [WeightFormat("int4", "fp16", "int8", 32, 0.005, "test", head_max_rows=3,
                                         packed_prompts=True)]}
    monkeypatch.setattr(hardware, "WEIGHT_FORMATS", fake)
    cfg = dict(max_num_seqs=4, max_model_len=512, compile=True)
    lm = shallow_model()
    served_weights(lm, "auto", pack_dense=False, max_decode_rows=4, traceable=True)
    assert lm.model.lm_head.dense == "keep" and not any(isinstance(m, Fp16Linear) for m in lm.model.modules())
    comp = make_llm_engine(lm, None, EngineConfig(**cfg))
    cd = comp.runner.compiled_decode
    assert cd.batch_buckets() == [1, 2, 4] and cd.uncompiled == [] and cd.graph_breaks == 0
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    prompts = [(nda_prompt[:n], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for n in (40, 55, 70, 85)]
    out = run_to_completion(comp, prompts)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # nothing compiled while serving
    assert [ev[-1].completion_tokens for ev in out] == [12] * 4
    fp16 = shallow_model()
    served_weights(fp16, "auto", pack_dense=False, max_decode_rows=4)
    assert isinstance(fp16.model.lm_head.dense_fp16, Fp16Linear)
    assert make_llm_engine(fp16, None, EngineConfig(**cfg)).runner.compiled_decode.graph_breaks > 0


def test_private_function_gets_its_own_code_object():
    """Each CompiledDecode compiles a private copy of forward_step: Dynamo keeps graphs and guards
    per code object, and with module guards filtered out a shared one could run another model's
    graph. The copy behaves as the original."""
    from sfcl.model.compiled import _private_function

    def f(x, *, y=2):
        """doc"""
        return x * y

    g = _private_function(f)
    assert g.__code__ is not f.__code__ and g.__code__ == f.__code__
    assert g(3) == f(3) == 6 and g(3, y=4) == 12
    assert (g.__name__, g.__doc__, g.__kwdefaults__) == (f.__name__, f.__doc__, f.__kwdefaults__)
