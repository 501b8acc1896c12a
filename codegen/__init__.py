"""pdwire code generator: YAML schema -> typed model -> evolution checks -> jinja2 output.

Pipeline (one module per step):

* :mod:`.schema_doc` - msgspec structs mirroring the YAML text, so a malformed schema
  fails while decoding with the file, message and field named;
* :mod:`.loader` - turns the document into the typed intermediate model of :mod:`.model`;
* :mod:`.evolution` - the rules a single schema must satisfy on its own;
* :mod:`.diff` - compatibility classification between two schemas;
* :mod:`.render` - builds per-layout view data and renders ``templates/*.j2``.
"""
