"""Which samples a read gets: batch policies, DP rounds and their token balance. Imports
only the model.

Map: docs/architecture.md#controller-floor-plan
"""
