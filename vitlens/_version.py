"""The version of vitlens, in a module of its own so that what records it (``environment``) needs nothing of the
package above it."""
__version__ = "0.2.0"
