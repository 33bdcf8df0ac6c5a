"""The coordinator's read-only web console at ``/ui`` (docs/operations.md, "Console")."""

from coordinator.api.ui.console import router

__all__ = ["router"]
