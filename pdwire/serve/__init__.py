"""``pdwire serve``: one role of a PD deployment per process (:mod:`.cli`, settings :mod:`.config`,
:mod:`.ranks`, the servers :mod:`.prefill` and :mod:`.decode`, the admin socket :mod:`.admin`).
"""
