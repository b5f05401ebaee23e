"""The controller's server: :class:`~._controller.Controller` builds the parts and routes each
request to one of them through the ``Door`` of ``_limits`` (bounds first); ``_prometheus``
reads its ``status()`` as metrics.

Map: docs/architecture.md#controller-floor-plan
"""
