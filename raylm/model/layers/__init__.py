"""Building blocks of the models: parallel linear layers, vocab-parallel
embedding and LM head, paged attention, rotary embedding, RMSNorm."""
