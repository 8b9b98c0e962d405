"""raylm: an LLM inference and serving engine whose model-parallel workers run
as Ray actors. Offline use: `from raylm import LLM, SamplingParams`.

The packages, highest layer first (imports point down only; tests/test_layering.py
checks it):
- testing: the Hugging Face oracle, tiny model folders and the chaos harness,
  for the tests (the engine never imports it);
- entrypoints: the `raylm` command (generate, serve, plan, bench) and the
  OpenAI-compatible server; ray_serve.py runs that server as a Ray Serve app;
- engine: the front ends (LLM, AsyncLLM), request intake and output assembly,
  the engine core and its process, and the supervisor of engine cores
  (routing, recovery, scaling, replica restarts, live migration);
- core: the scheduler, its requests and the paged KV-cache blocks;
- executor: how calls reach the model ranks (in-process, multiprocess, Ray);
- worker: one model rank (device, KV cache, model runner, sampler) and the
  CPU cores and threads it runs on (cpu_placement);
- kv_transfer: K/V blocks moving between engines (live migration's stages,
  through shared memory on one node or sealed over the network);
- config: every setting, declared once, resolved against the model and device;
- model: the Llama-family models, their layers and C++ CPU kernels
  (model/layers/csrc, built at first use), GGUF files and quantized weights;
- distributed: process groups, collectives and the step queues between ranks.

Below them all, plain values any layer may use: sampling_params, outputs,
messages (a step's messages), chat_template (bounded rendering), cpu_bind and
thread_accounting (CPU sets, and what Linux says of a process's threads),
log_text (client text made safe to log) and startup_heap.
"""

__version__ = "0.1.0"

from raylm.engine.llm import LLM
from raylm.outputs import CompletionOutput, RequestOutput
from raylm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
