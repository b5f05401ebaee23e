"""What the controller knows: partitions (schema, samples, consumption, keys), grant and unit
records, parked requests and the state the parts share. Imports nothing of the parts,
planning or the server.

Map: docs/architecture.md#controller-floor-plan
"""
