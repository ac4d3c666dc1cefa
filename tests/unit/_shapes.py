"""Model shapes written out by hand for the memory tests (no torch needed)."""

from dynaresize.costmodel import memory

# Qwen2-7B's shape as roles/model_shape.py reads it from its config.json (tests/unit/test_preflight.py
# checks the reader gives exactly these counts); written out here so these tests need no torch.
H, L, HEADS, KV, HD, I, V = 3584, 28, 28, 4, 128, 18944, 152064
LAYER = 2 * H + (H * H + H) + 2 * (H * KV * HD + KV * HD) + H * H + 3 * H * I  # norms, q (+bias), k, v, o, MLP
ROOT = 2 * V * H + H  # untied embedding and lm_head, final norm
QWEN2_7B = memory.ModelShape(
    name="Qwen2-7B", num_params=L * LAYER + ROOT, num_layers=L, hidden_size=H, intermediate_size=I, num_heads=HEADS,
    num_kv_heads=KV, head_dim=HD, vocab_size=V, tie_word_embeddings=False, layer_params=LAYER, root_params=ROOT,
    largest_param=V * H,
    # The most two consecutive sync buckets (256 MiB, fused units kept whole) hold: in bf16 lm_head and
    # the bucket before it (the last block's down_proj, its two norms, the final norm); in fp32 the
    # embedding and the bucket after it (block 0's q/k/v with biases and o_proj).
    sync_staging_bytes=((2, 2 * (V * H + H * I + 3 * H)),
                        (4, 4 * (V * H + H * H + H + 2 * (H * KV * HD + KV * HD) + H * H))))
