"""The demos, on the top floor: ``tqueue demo`` (:mod:`.simulated`, producers and DP ranks
simulated on the embedded local cluster), ``tqueue demo --engine vllm`` (:mod:`.engine`, a real
vLLM engine and, with ``--trainer megatron``, megatron-core ranks), and the tiny random model the
engine demo and its tests load (:mod:`.tiny_model`). They use the library from above, as a
user's program would; nothing in the library imports them but the command line.

Run as docs/api.md, "Command line" shows; the engine demo in docs/bridges.md, "tqueue demo --engine vllm".

Map: docs/architecture.md#launch-bridges-and-demos
"""
