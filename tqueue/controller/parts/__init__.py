"""What acts on the model, one part per concern: writes, reads, moves, cleanup, copies, units,
checkpoints, keys, resets, row allocations, the trainer's version, corrupt copies. A part
imports the model and planning; parts reach each other only through callables the server
hands them.

Map: docs/architecture.md#controller-floor-plan
"""
