"""``pdwire serve``: one role of a PD deployment per process (config, ranks, discovery, admin).

:mod:`.config` (settings from file, environment, flags), :mod:`.ranks` (a rank's backend and
memory, the synthetic workload), :mod:`.prefill` and :mod:`.decode` (the two servers),
:mod:`.admin` (the decode server's command socket), :mod:`.cli` (the command).
"""
