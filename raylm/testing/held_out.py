"""What the quality checks of quantized models read: a passage the embedded
Shakespeare model never trained on (the epilogue of The Tempest: the last 5% of
each work was held out), and the tensor types of a Q4_K_M-like GGUF mix. Shared
by tests/model/test_quant_quality.py and benchmarks/perplexity_llamacpp.py."""

from __future__ import annotations

# The Tempest, Epilogue (public domain).
HELD_OUT = """Now my charms are all o'erthrown,
And what strength I have's mine own,
Which is most faint: now, 'tis true,
I must be here confined by you,
Or sent to Naples. Let me not,
Since I have my dukedom got
And pardon'd the deceiver, dwell
In this bare island by your spell;
But release me from my bands
With the help of your good hands:
Gentle breath of yours my sails
Must fill, or else my project fails,
Which was to please. Now I want
Spirits to enforce, art to enchant,
And my ending is despair,
Unless I be relieved by prayer,
Which pierces so that it assaults
Mercy itself and frees all faults.
As you from crimes would pardon'd be,
Let your indulgence set me free.
"""


def q4_k_m(name: str, shape) -> str:
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"
