"""What the engines' counter-based sampling noise shares (torch_engine.sampling and
mlx_engine.sampling draw the same numbers, bit for bit).

A uniform is made of its 32 random bits' top UNIFORM_BITS: (b + 0.5) / 2**23 is exact in
float32 and strictly inside (0, 1). With 24 bits the largest, (2**24 - 0.5) / 2**24, rounded to
1.0 (one column in 2**24): its noise -log(1) was 0, and a token of probability 0 (masked by a
grammar, under min_p, or underflowed) scored 0 / 0 = NaN, which argmax takes. A forced tool call
then left its grammar in about one request in 25 at temperature 0.7 (scripts/soak.py found
it)."""

UNIFORM_BITS = 23
