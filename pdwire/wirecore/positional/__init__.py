"""The positional layout (SGLang's frames): one frame per field, no header.

:mod:`.encodings` (the per-field frame codecs a schema's ``encoding:`` names), :mod:`.codec`
(message table, recognition and dispatch), :mod:`.errors` (the profile's typed errors).
"""
