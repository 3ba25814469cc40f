# CPU emulation for bench/patches/nvfp4-two-step-1d.patch: the one-step compact flush
# (flush_both_scales) against the two-step path (flush_scratch + tessera_nvfp4_scales_1d)
# on ragged shapes: every grid byte written by both, from the same staged byte of the same
# tile. Run: python3 bench/patches/nvfp4-two-step-1d-emulate.py
def cols4(n): return (n + 3) // 4 * 4
def one_step(m, k):
    out = {}
    tr, tc = (m + 127)//128, (k + 127)//128
    for R in range(tr):
        for C in range(tc):
            R0, C0 = 128*R, 128*C
            for t in range(256):
                r, jb = R0 + t//2, C0//16 + 4*(t % 2)
                if r < m and jb < k//16:
                    for b in range(4): out[('row', r*cols4(k//16) + jb + b)] = ('row', (R, C), t//2, 4*(t%2)+b)
                c, ib = C0 + t//2, R0//16 + 4*(t % 2)
                if c < k and ib < m//16:
                    for b in range(4): out[('col', c*cols4(m//16) + ib + b)] = ('col', (R, C), t//2, 4*(t%2)+b)
    return out
def two_step(m, k):
    tr, tc = (m + 127)//128, (k + 127)//128
    scratch = {}
    for R in range(tr):
        for C in range(tc):
            tile = R*tc + C
            for t in range(128):
                g = 'row' if t < 64 else 'col'
                for byte in range(16):
                    idx = 16*(t & 63) + byte
                    scratch[tile*2048 + (0 if t < 64 else 1024) + idx] = (g, (R, C), idx // 8, idx % 8)
    out = {}
    for cols in (False, True):
        rows, per_row = (k, tr) if cols else (m, tc)
        blocks = (m if cols else k)//16
        stride = cols4(m//16) if cols else cols4(k//16)
        for t in range(rows*per_row):
            r, p = t // per_row, t % per_row
            tile = p*tc + r//128 if cols else (r//128)*tc + p
            base = tile*2048 + (1024 if cols else 0) + (r % 128)*8
            second = 8*p + 4 < blocks
            n = 8 if second else 4
            for b in range(n):
                out[('col' if cols else 'row', r*stride + 8*p + b)] = scratch[base + b]
    return out
bad = 0
for m, k in [(4112, 16400), (1040, 4160), (2048, 1056), (128, 128), (16, 64), (528, 4096), (272, 1040), (16, 16), (144, 2064)]:
    a, b = one_step(m, k), two_step(m, k)
    ok = a == b
    bad += not ok
    print(m, k, 'same' if ok else f'DIFF {len(a)} {len(b)} {len(set(a)^set(b))} {sum(1 for x in a if x in b and a[x]!=b[x])}')
print('bad', bad)
