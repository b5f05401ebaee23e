"""The controller's server: :class:`~._controller.Controller` routes each request to a part,
after the bounds of ``_limits``; ``_prometheus`` reads its ``status()`` as metrics.

Map: docs/architecture.md#controller-floor-plan
"""
