"""Wire types: v1/tandem.proto (package tandem.v1) and its generated code; generate.py regenerates it."""
