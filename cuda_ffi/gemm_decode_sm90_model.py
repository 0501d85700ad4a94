"""Bit-level model of one warp's chunk column in gemm_decode_sm90.cuh, checked against the contract.

The kernel's correctness rests on index and bit tricks that cannot be unit-tested without a GPU:
each lane copies a contiguous 16-byte chunk of a weight row and reads the activations of the same
k positions, so the k order inside an mma.sync step is a permutation that A and B must share; int4
and e2m1 codes are turned into bf16/f16 pairs (k, k + 4) by magic-number bit operations and the
activations are permuted to match with prmt; 8-bit codes become exact f16 pairs. This script
emulates those operations on the host (lop3, prmt, shifts, packed 16-bit sub/mul rounded to
nearest even with subnormals kept, the e4m3x2 -> f16x2 conversion), assembles the m16n8k16
fragments lane by lane as PTX defines them, and compares the warp's sums with
sum_k a(k) * w'(k), w' = round_act(f32(code * scale) (* scale2)) (float32 codes * scales for 8-bit
activations; int8 x int8 through the integer m16n8k32 fragments), for every weight type,
dequantization mode and token-tile count. It also checks the
packed conversions exhaustively. Run it after changing the lane mapping or a conversion:

    python3 cuda_ffi/gemm_decode_sm90_model.py [seed]
"""
import itertools, sys
import numpy as np, ml_dtypes

BF16, F16 = ml_dtypes.bfloat16, np.float16
E4M3 = ml_dtypes.float8_e4m3fn
M32 = 0xFFFFFFFF
rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)

def u16_to_f(h, f16):  # 16-bit pattern -> float64
    return float(np.array([h], np.uint16).view(F16 if f16 else BF16)[0])
def f_to_u16(v, f16):  # RNE to 16-bit (v exact in f64 or f32)
    return int(np.array([v], np.float64).astype(np.float32).astype(F16 if f16 else BF16).view(np.uint16)[0]) if not f16 else int(np.array([v], np.float64).astype(F16).view(np.uint16)[0])
def lo(x): return x & 0xffff
def hi(x): return (x >> 16) & 0xffff
def pack(l, h): return (l & 0xffff) | ((h & 0xffff) << 16)
def and_or(a, b, c): return ((a & b) | c) & M32
def shl(x, s): return (x << s) & M32 if s >= 0 else x >> (-s)
def byte_perm(x, y, s):
    b = [(x >> (8*i)) & 0xff for i in range(4)] + [(y >> (8*i)) & 0xff for i in range(4)]
    return sum(b[(s >> (4*i)) & 7] << (8*i) for i in range(4))
def hop2(a, b, f16, op):
    r = []
    for x, y in ((lo(a), lo(b)), (hi(a), hi(b))):
        fx, fy = u16_to_f(x, f16), u16_to_f(y, f16)
        v = fx - fy if op == "sub" else fx * fy  # exact in f64 for these operands
        r.append(f_to_u16(v, f16))
    return pack(*r)
def hsub2(a, b, f16): return hop2(a, b, f16, "sub")
def hmul2(a, b, f16): return hop2(a, b, f16, "mul")

def u4_code_pair(q, P, zm): return hsub2(and_or(shl(q, -4*P), 0x000f000f, 0x64006400), zm, True)
def e2m1_bits(q, P, MB):
    mag_mask = (7 << MB) | (7 << (MB + 16))
    sign = shl(q, 12 - 4*P) & 0x80008000
    return and_or(shl(q, MB - 4*P), mag_mask, sign)
def fp4_code_pair(q, P): return hmul2(e2m1_bits(q, P, 9), 0x74007400, True)
def i8_code_pair(w, P):
    h = byte_perm(w ^ 0x80808080, 0x64646464, 0x4140 if P == 0 else 0x4342)
    return hsub2(h, 0x64806480, True)
def fp8_code_pair(w, P):
    v = (w & 0xffff) if P == 0 else (w >> 16)
    f = np.array([v & 0xff, v >> 8], np.uint8).view(E4M3).astype(np.float32).astype(F16).view(np.uint16)
    return pack(int(f[0]), int(f[1]))

E2M1 = [0.0, .5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
def e2m1(n): v = E2M1[n & 7]; return -v if n & 8 else v
def e8m0(s): return float("nan") if s == 255 else 2.0 ** (s - 127)

def scale_to_float(st, raw):
    if st == "f32": return float(np.array([raw], np.uint32).view(np.float32)[0])
    if st == "bf16": return u16_to_f(raw, False)
    if st == "f16": return u16_to_f(raw, True)
    if st == "e8m0": return e8m0(raw)
    if st == "e4m3": return float(np.array([raw], np.uint8).view(E4M3)[0])

class Cfg:
    def __init__(s, wt, ak, dq, st=None, has_s2=False, zero=False):
        s.wt, s.ak, s.dq, s.st, s.has_s2, s.zero = wt, ak, dq, st, has_s2, zero
        s.q8 = ak in ("fp8", "i8"); s.f16 = ak != "bf16"
        s.four = wt in ("u4", "fp4"); s.epc = 8 if wt == "float" else (32 if s.four else 16)
        s.kw = 4 * s.epc

def deq_pair(c, P, word, sraw, z, s2):
    if c.dq == "codes" or c.dq == "f32":
        if c.wt == "u4": cp = u4_code_pair(word, P, ((0x6400 + z) * 0x10001) & M32)
        elif c.wt == "fp4": cp = fp4_code_pair(word, P)
        elif c.wt == "i8": cp = i8_code_pair(word, P)
        else: cp = fp8_code_pair(word, P)
        if c.dq == "codes": return cp
        sc = scale_to_float(c.st, sraw)
        l = np.float32(u16_to_f(lo(cp), True)) * np.float32(sc)
        h = np.float32(u16_to_f(hi(cp), True)) * np.float32(sc)
        if c.has_s2: l, h = l * np.float32(s2), h * np.float32(s2)
        return pack(f_to_u16(float(l), c.f16), f_to_u16(float(h), c.f16))
    if c.dq == "packed_u4":
        magic = 0x64006400 if c.f16 else 0x43004300
        m = and_or(shl(word, -4*P), 0x000f000f, magic)
        zm = (((0x6400 if c.f16 else 0x4300) + z) * 0x10001) & M32
        return hmul2(hsub2(m, zm, c.f16), (sraw * 0x10001) & M32, c.f16)
    if c.dq == "packed_fp4":
        bits = e2m1_bits(word, P, 6)
        f2 = 0
        if sraw <= 128: f1 = (sraw + 126) << 7
        elif sraw == 255: f1 = 0x7fc0
        else: f1, f2 = 0x7f00, (sraw - 1) << 7
        r = hmul2(bits, (f1 * 0x10001) & M32, False)
        if f2: r = hmul2(r, (f2 * 0x10001) & M32, False)
        return r
    raise ValueError(c.dq)

def act_code_pair(c, w, P): return i8_code_pair(w, P) if c.ak == "i8" else fp8_code_pair(w, P)

def words_of(b):  # bytes -> little-endian uint32 words
    b = np.asarray(b, np.uint8)
    return [int(x) for x in b.view(np.uint32)]

def simulate(c, W, A, S, Z, s2, wq, aq, TOKT, nvalid):
    """W: weight bytes [32 rows][chunk column bytes=64]; A: activation bytes [32 tokens][kw*asz]
    Returns acc[32 rows][32 tokens] as computed by the warp's fragments."""
    NT = 2
    acc = np.zeros((32, 32))
    # per-lane data
    lanes = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        w = [[words_of(W[i*16 + g + 8*h][t*16:(t+1)*16]) for h in range(2)] for i in range(NT)]
        lanes[lane] = (g, t, w)
    asz = 1 if c.q8 else 2
    def arow(g, t, j):  # bytes of token g+8j at this lane's k positions
        return A[g + 8*j][t*c.epc*asz:(t+1)*c.epc*asz]
    # Build per-step fragments: steps list of (A regs per lane, B regs per lane per j)
    steps = []
    if c.wt == "float":
        for st in range(2):
            fr = {}
            for lane in range(32):
                g, t, w = lanes[lane]
                b = [words_of(arow(g, t, j)) if g + 8*j < nvalid else [0]*4 for j in range(TOKT)]
                fr[lane] = ([[w[i][0][2*st], w[i][1][2*st], w[i][0][2*st+1], w[i][1][2*st+1]] for i in range(NT)],
                            [(b[j][2*st], b[j][2*st+1]) for j in range(TOKT)])
            steps.append(fr)
    elif not c.four:
        for st in range(4):
            fr = {}
            for lane in range(32):
                g, t, w = lanes[lane]
                bj = []
                for j in range(TOKT):
                    ok = g + 8*j < nvalid
                    if c.q8:
                        y = words_of(arow(g, t, j)) if ok else [0]*4
                        bj.append((act_code_pair(c, y[st], 0), act_code_pair(c, y[st], 1)))
                    else:
                        y = words_of(arow(g, t, j)) if ok else [0]*8
                        bj.append((y[2*st], y[2*st+1]))
                sl = 1 if (c.dq == "f32" and st >= 2) else 0
                A_ = []
                for i in range(NT):
                    p01 = [deq_pair(c, 0, w[i][h][st], S[i][h][lane][sl], 0, s2) for h in range(2)]
                    p23 = [deq_pair(c, 1, w[i][h][st], S[i][h][lane][sl], 0, s2) for h in range(2)]
                    A_.append([p01[0], p01[1], p23[0], p23[1]])
                fr[lane] = (A_, bj)
            steps.append(fr)
    else:
        for wd in range(4):
            frs = [{}, {}]
            for lane in range(32):
                g, t, w = lanes[lane]
                bj = []
                for j in range(TOKT):
                    ok = g + 8*j < nvalid
                    if c.q8:
                        y = words_of(arow(g, t, j)[wd*8:wd*8+8]) if ok else [0, 0]
                        q0, q1 = byte_perm(y[0], y[1], 0x5140), byte_perm(y[0], y[1], 0x7362)
                        bj.append([act_code_pair(c, q0, 0), act_code_pair(c, q0, 1), act_code_pair(c, q1, 0), act_code_pair(c, q1, 1)])
                    else:
                        x = words_of(arow(g, t, j)[wd*16:wd*16+16]) if ok else [0]*4
                        bj.append([byte_perm(x[0], x[2], 0x5410), byte_perm(x[0], x[2], 0x7632),
                                   byte_perm(x[1], x[3], 0x5410), byte_perm(x[1], x[3], 0x7632)])
                sl = 1 if (c.dq == "f32" and wd >= 2) else 0
                A0, A1 = [], []
                for i in range(NT):
                    pr = [[deq_pair(c, P, w[i][h][wd], S[i][h][lane][sl], Z[i][h][lane] if c.wt == "u4" else 0, s2)
                           for P in range(4)] for h in range(2)]
                    A0.append([pr[0][0], pr[1][0], pr[0][1], pr[1][1]])
                    A1.append([pr[0][2], pr[1][2], pr[0][3], pr[1][3]])
                frs[0][lane] = (A0, [(b[0], b[1]) for b in bj])
                frs[1][lane] = (A1, [(b[2], b[3]) for b in bj])
            steps += frs
    if c.wt == "i8" and c.ak == "i8":  # integer m16n8k32 on the codes as they are (kNative8)
        def s8(x, b): v = (x >> (8 * b)) & 0xff; return v - 256 if v >= 128 else v
        for st in range(2):
            for i in range(NT):
                for j in range(TOKT):
                    Am = np.zeros((16, 32)); Bm = np.zeros((32, 8))
                    for lane in range(32):
                        g, t, w = lanes[lane]
                        y = words_of(arow(g, t, j)) if g + 8*j < nvalid else [0]*4
                        a = [w[i][0][2*st], w[i][1][2*st], w[i][0][2*st+1], w[i][1][2*st+1]]
                        for r, (row, k0) in enumerate([(g, 4*t), (g+8, 4*t), (g, 16+4*t), (g+8, 16+4*t)]):
                            for b in range(4): Am[row, k0 + b] = s8(a[r], b)
                        for r, k0 in enumerate([4*t, 16+4*t]):
                            for b in range(4): Bm[k0 + b, g] = s8(y[2*st + r], b)
                    acc[i*16:(i+1)*16, j*8:(j+1)*8] += Am @ Bm
        return acc
    f16 = c.f16
    for fr in steps:
        for i in range(NT):
            for j in range(TOKT):
                Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    a = fr[lane][0][i]; b = fr[lane][1][j]
                    for r, (row, s0) in enumerate([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]):
                        Am[row, s0] = u16_to_f(lo(a[r]), f16); Am[row, s0+1] = u16_to_f(hi(a[r]), f16)
                    for r, s0 in enumerate([2*t, 2*t+8]):
                        Bm[s0, g] = u16_to_f(lo(b[r]), f16); Bm[s0+1, g] = u16_to_f(hi(b[r]), f16)
                acc[i*16:(i+1)*16, j*8:(j+1)*8] += Am @ Bm
    return acc

def run_case(c, TOKT, nvalid, trials=2):
    asz = 1 if c.q8 else 2
    for _ in range(trials):
        W = rng.integers(0, 256, (32, 64), dtype=np.uint8)
        if c.wt == "float":
            vals = (rng.standard_normal((32, 32))).astype(F16 if c.f16 else BF16)
            W = vals.view(np.uint8).reshape(32, 64)
        if c.wt == "fp8":
            W = np.where((W & 0x7f) == 0x7f, 0x11, W).astype(np.uint8)  # no NaN codes
        if c.q8:
            if c.ak == "fp8":
                A = rng.standard_normal((32, c.kw)).astype(E4M3).view(np.uint8)
            else:
                A = rng.integers(-127, 128, (32, c.kw)).astype(np.int8).view(np.uint8)
        else:
            A = rng.standard_normal((32, c.kw)).astype(F16 if c.f16 else BF16).view(np.uint8).reshape(32, c.kw * 2)
        # scales: per (i, h, lane, slot) raw; generated per (row, k-group of half chunks)
        nslot = 2 if c.dq == "f32" else 1
        raw_rs = {}
        def gen_raw():
            if c.st == "f32": return int(np.array([rng.random() * 0.1 + 0.01], np.float32).view(np.uint32)[0])
            if c.st in ("bf16", "f16"): return f_to_u16(rng.random() * 0.1 + 0.01, c.st == "f16")
            if c.st == "e8m0": return int(rng.choice([0, 1, 100, 120, 127, 128, 129, 131] if c.f16 else [0, 1, 100, 120, 127, 128, 129, 140, 200, 254]))
            if c.st == "e4m3": return int(np.array([rng.random() * 4 + 0.01], np.float32).astype(E4M3).view(np.uint8)[0])
            return 0
        # per row r and per lane-quad t and slot: a raw scale; zero point per row and t
        R = {(r, t, sl): gen_raw() for r in range(32) for t in range(4) for sl in range(2)}
        Zr = {(r, t): int(rng.integers(0, 16)) if c.zero else 8 for r in range(32) for t in range(4)}
        if nslot == 1:
            for r in range(32):
                for t in range(4): R[(r, t, 1)] = R[(r, t, 0)]
        if c.q8:  # one scale per chunk column: same for all t
            for r in range(32):
                for t in range(4):
                    R[(r, t, 0)] = R[(r, t, 1)] = R[(r, 0, 0)]
        S = [[[[R[(i*16 + (l >> 2) + 8*h, l & 3, sl)] for sl in range(2)] for l in range(32)] for h in range(2)] for i in range(2)]
        Z = [[[Zr[(i*16 + (l >> 2) + 8*h, l & 3)] for l in range(32)] for h in range(2)] for i in range(2)]
        s2 = float(np.float32(rng.random() + 0.5))
        acc = simulate(c, W, A, S, Z, s2, None, None, TOKT, nvalid)
        # Reference: per row r, k in the chunk column: w'(r, k), a(tok, k)
        ref = np.zeros((32, 32))
        for r in range(32):
            wv = []
            for k in range(c.kw):
                t = k // c.epc; kk = k - t * c.epc
                sl = 1 if (nslot == 2 and kk >= c.epc // 2) else 0
                raw = R[(r, t, sl)]
                if c.wt == "float":
                    v = u16_to_f(int(W[r, 2*k]) | (int(W[r, 2*k+1]) << 8), c.f16); wv.append(v); continue
                b = int(W[r, t*16 + (kk if not c.four else kk // 2)])
                if c.wt == "u4": code = ((b >> 4) if kk & 1 else (b & 15)) - Zr[(r, t)]
                elif c.wt == "fp4": code = e2m1((b >> 4) if kk & 1 else (b & 15))
                elif c.wt == "i8": code = b - 256 if b >= 128 else b
                else: code = float(np.array([b], np.uint8).view(E4M3)[0])
                if c.q8: wv.append(code); continue
                v = np.float32(code) * np.float32(scale_to_float(c.st, raw))
                if c.has_s2: v = v * np.float32(s2)
                wv.append(u16_to_f(f_to_u16(float(v), c.f16), c.f16))
            wv = np.array(wv)
            for tok in range(32):
                if tok >= min(nvalid, 8 * TOKT): continue
                if c.q8:
                    av = A[tok].view(E4M3).astype(np.float64) if c.ak == "fp8" else A[tok].view(np.int8).astype(np.float64)
                else:
                    av = A[tok].view(F16 if c.f16 else BF16).astype(np.float64)
                ref[r, tok] = np.dot(wv, av)
        mask = np.zeros((32, 32), bool); mask[:, :min(nvalid, 8*TOKT)] = True
        got = acc[mask]; want = ref[mask]
        err = np.max(np.abs(got - want) / (np.abs(want) + 1e-30 + np.abs(want).max() * 1e-12))
        fin = np.isfinite(want)
        ok = np.array_equal(np.isnan(got), np.isnan(want)) and np.allclose(got[fin], want[fin], rtol=1e-9, atol=1e-12 * max(1, np.abs(want[fin]).max(initial=0)))
        if not ok:
            print("MISMATCH", c.__dict__, TOKT, nvalid, err); bad = np.argwhere(~np.isclose(acc, ref) & mask)[:5]; print(bad, acc[tuple(bad.T)], ref[tuple(bad.T)])
            return False
    return True

cases = [
    Cfg("float", "bf16", "raw"), Cfg("float", "f16", "raw"),
    Cfg("u4", "bf16", "packed_u4", "bf16"), Cfg("u4", "f16", "packed_u4", "f16", zero=True), Cfg("u4", "bf16", "packed_u4", "bf16", zero=True),
    Cfg("u4", "bf16", "f32", "f32", zero=True), Cfg("u4", "f16", "f32", "bf16", has_s2=True),
    Cfg("u4", "fp8", "codes", "f32", zero=True), Cfg("u4", "i8", "codes", "f32"),
    Cfg("i8", "bf16", "f32", "f32"), Cfg("i8", "f16", "f32", "f16", has_s2=True), Cfg("i8", "i8", "codes", "f32"), Cfg("i8", "fp8", "codes", "f32"),
    Cfg("fp8", "bf16", "f32", "f32"), Cfg("fp8", "f16", "f32", "f32", has_s2=True), Cfg("fp8", "fp8", "codes", "f32"), Cfg("fp8", "i8", "codes", "f32"),
    Cfg("fp4", "bf16", "packed_fp4", "e8m0"), Cfg("fp4", "bf16", "f32", "e4m3", has_s2=True), Cfg("fp4", "f16", "f32", "e8m0"),
    Cfg("fp4", "fp8", "codes", "e8m0"), Cfg("fp4", "i8", "codes", "e8m0"),
]
allok = True
for c in cases:
    # Four token tiles (items of up to 32 rows) only for quantized weights with 16-bit
    # activations (Kern::kWideItems).
    wide = ((4, 17), (4, 32)) if not c.q8 and c.wt != "float" else ()
    ok = True
    for TOKT, nvalid in ((1, 1), (1, 8), (2, 11), (2, 16)) + wide:
        ok &= run_case(c, TOKT, nvalid, trials=1)
    allok &= ok
    print(("ok  " if ok else "FAIL"), c.wt, c.ak, c.dq, c.st, "s2" if c.has_s2 else "", "zero" if c.zero else "")
# Exhaustive element checks of the packed e2m1/e8m0 path and the f16 code paths.
def contract_bf16(v32):
    return f_to_u16(float(v32), False)
bad = 0
for sc in range(255):
    for n0 in range(16):
        for n4 in range(16):
            q = n0 | (n4 << 16)   # nibble 0 and nibble 4 -> pair 0
            r = deq_pair(Cfg("fp4", "bf16", "packed_fp4", "e8m0"), 0, q, sc, 0, 1.0)
            for nib, half in ((n0, lo(r)), (n4, hi(r))):
                with np.errstate(over="ignore"):
                    want = np.float32(e2m1(nib)) * np.float32(e8m0(sc))
                w16 = contract_bf16(want)
                if w16 != half and not (np.isnan(want) and np.isnan(u16_to_f(half, False))):
                    bad += 1
                    if bad < 5: print("packed fp4 mismatch", sc, nib, hex(half), hex(w16))
print("packed fp4 exhaustive:", "ok" if bad == 0 else f"{bad} bad")
bad = 0
for q in range(16):
    for z in range(16):
        r = u4_code_pair(q | (q << 16), 0, ((0x6400 + z) * 0x10001) & M32)
        if u16_to_f(lo(r), True) != q - z: bad += 1
    r = fp4_code_pair(q | (q << 16), 0)
    if u16_to_f(lo(r), True) != e2m1(q) or u16_to_f(hi(r), True) != e2m1(q): bad += 1; print("fp4 code", q)
for b in range(256):
    for P in (0, 1):
        w = (b << (16 * P)) | (b << (16 * P + 8))
        r = i8_code_pair(w, P)
        sb = b - 256 if b >= 128 else b
        if u16_to_f(lo(r), True) != sb or u16_to_f(hi(r), True) != sb: bad += 1
        if (b & 0x7f) != 0x7f:
            r = fp8_code_pair(w, P)
            v = float(np.array([b], np.uint8).view(E4M3)[0])
            if u16_to_f(lo(r), True) != v: bad += 1
print("code pairs exhaustive:", "ok" if bad == 0 else f"{bad} bad")
# packed u4 exhaustive over q, z and a sample of scales, both activation types
bad = 0
for f16 in (False, True):
    c = Cfg("u4", "f16" if f16 else "bf16", "packed_u4", "f16" if f16 else "bf16")
    for sraw in list(range(0, 65536, 257)) + [1, 0x3f80, 0x0001, 0x7bff]:
        if (sraw & 0x7fff) > (0x7c00 if f16 else 0x7f80): continue  # NaN scales
        for q in range(16):
            for z in range(16):
                r = deq_pair(c, 0, q, sraw, z, 1.0)
                want = np.float32(q - z) * np.float32(u16_to_f(sraw, f16))
                w16 = f_to_u16(float(want), f16)
                if r & 0xffff != w16: bad += 1
print("packed u4 exhaustive:", "ok" if bad == 0 else f"{bad} bad")
print("ALL OK" if allok else "FAILURES")
