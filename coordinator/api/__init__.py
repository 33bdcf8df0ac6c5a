"""The coordinator's HTTP side: the FastAPI app, its dependencies and auth, routes per resource,
the ops app of a consumers-only process and the operator console (``ui``).

Routes read the ledger and write decisions through the handlers; nothing below imports this
package.
"""
