def clamp(x, lo, hi):
    if x < lo:
        return lo
    return x
