import mlx.core as mx, sys
sys.path.insert(0, "tests")
from pippin.engine import paged_attention as pa
from test_paged_attention import _case
for dt in (mx.float32, mx.bfloat16):
    q, k, v, t, o = _case(5, 32, 8, 64, dt)
    try:
        out = pa.paged_decode_attention(q, k, v, t, o, 0.125, 16); mx.eval(out)
        ref = pa.reference_decode_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), t, o, 0.125, 16)
        print(dt, "OK err", mx.max(mx.abs(out.astype(mx.float32) - ref)).item())
    except Exception as e:
        s = str(e); print(dt, "FAIL", s[:200]); print("\n".join(l for l in s.splitlines() if "error" in l or "^" in l or l.strip().startswith(("const","float","int","for","if","qs","s[","uint"))))
