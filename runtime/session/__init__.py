"""The protocol's pure core: per-peer connection machines and per-room state machines.

Everything here takes values and returns values, in the manner of h11: the connection machines
(``prefill_connection``, ``decode_connection``, with ``hello`` and ``registration``) turn decoded
messages into typed ``events`` and actions into messages; the room machines (``prefill_room``,
``prefill_session``, ``decode_room``, ``decode_session``, ``room_table``) turn events into
``actions``; ``group_route`` derives who feeds a decode rank once per prefill group, and
``group_connect`` runs a decode rank's connect to one group without blocking. Sockets,
engines and clocks live only in :mod:`pdwire.runtime.workers`. Import from the modules.
"""
