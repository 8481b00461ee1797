"""Wire types: `.proto` definitions and their generated code (filled by a later issue)."""
