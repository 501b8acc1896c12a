"""The I/O edge an engine embeds: prefill and decode workers (sockets, backend, clock around the
pure session), the thread runner, and the wait while transfers are in flight. The public names
are re-exported by :mod:`pdwire.runtime.engine`."""
