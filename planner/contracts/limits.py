"""Upper bounds on every size a user gives, in one place: the contracts, the service's request bodies
and the command-line flags all read them here.

Each bound is far above any training job run so far, so a value past it is a typo or a unit slip
(tokens for sequences, bytes for GiB), not a plan; it also keeps every loop of the search over
divisors and stages short, whatever is asked.
"""

from __future__ import annotations

# -- the model (ModelSpec); the largest published: 126 layers, hidden 18,432 (Llama 3.1 405B,
# DeepSeek-V3 has 7,168), 128 heads, vocabularies of 256k (Gemma), 256 routed experts (DeepSeek-V3)
MAX_LAYERS = 4096
MAX_HIDDEN = 262_144  # hidden size, head dims, MLA ranks
MAX_HEADS = 4096
MAX_FFN = 1_048_576  # dense and expert FFN intermediate sizes
MAX_VOCAB = 4_194_304
MAX_EXPERTS = 16_384  # routed or shared experts per MoE layer; top_k and layer_frequency too
MAX_CAPACITY_FACTOR = 1024.0  # MoE token capacity over a perfect balance (1.0-2.0 in use)

# -- one optimizer step (TrainingConfig); published runs: 4k-128k token sequences, 1k-16k sequences
# or ~4M-63M tokens per step (Llama 3: 16M; DeepSeek-V3: 15,360 x 4,096)
MAX_SEQ = 16_777_216  # tokens per sequence, 2^24 (also the longest learned position table)
MAX_GLOBAL_BATCH = 16_777_216  # sequences per step, 2^24
MAX_GLOBAL_BATCH_TOKENS = 2**36  # tokens per step, ~69 G

# -- the cluster (ClusterProfile, plan requests); the largest training clusters hold ~100k-200k GPUs
MAX_GPUS = 1_048_576  # devices in a cluster, 2^20; also caps every parallel degree of a layout
MAX_GPUS_PER_NODE = 1024
MAX_DEVICE_MEMORY_BYTES = 2**46  # 64 TiB: a CPU rank's "device" is its host's memory
MAX_SM_COUNT = 65_536  # streaming multiprocessors of one device (H100: 132)

# -- the search's options (API PlanOptions, `autopar plan` flags)
MAX_TOP_K = 50  # alternatives kept
MAX_MICRO_BATCH = 1024  # largest micro-batch (sequences) the search may try
MAX_VIRTUAL_STAGES = 64  # model chunks per pipeline rank (interleaved 1F1B)
MAX_TIME_BUDGET_S = 3600.0  # seconds a search may run; the service's AUTOPAR_PLAN_BUDGET_S may allow less

ONE_KERNEL = 1 << 20
"""``Assumptions.grouped_gemm_streams`` of a single grouped kernel (``torch._grouped_mm``): every local expert's
tiles share its waves and it launches once per grouped linear (more than any ``MoESpec.num_experts``)."""
MAX_FALLBACKS = 8  # fallback plans (lost nodes 1..K) a plan may carry: each is a search of its own
