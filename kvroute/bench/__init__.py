"""The one home of kvroute's measurements, behind ``kvroute bench <name>``. Not part of
the serving path: product packages never import it (``make lint`` checks it)."""
