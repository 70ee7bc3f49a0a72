"""Weight quantization (``sfcl.model.quant``) on odd input widths."""



def test_quantlinear_int8_bf16_odd_in_features_does_not_crash():
    """BUG (same kernel): ``--weight-quant int8`` on a bf16 model whose linear in_features is not a
    multiple of 16 segfaults in torch._weight_int8pack_mm (float32/float16 inputs work). int4
    rejects K % 32 != 0 with a ValueError; int8 has no such check. Subprocess: the crash kills it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\nfrom sfcl.model.quant import QuantLinear\n"
            "l = torch.nn.Linear(24, 8, bias=False).bfloat16()\n"
            "x = torch.randn(2, 24).bfloat16()\n"
            "try:\n    y = QuantLinear.from_linear(l, 'int8', 6)(x)\nexcept ValueError:\n    print('OK'); raise SystemExit\n"
            "assert torch.allclose(y.float(), l(x).float(), atol=0.1)\nprint('OK')\n")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc={r.returncode} stderr={r.stderr[-500:]}"
