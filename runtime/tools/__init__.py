"""Tool calling: tool declarations checked, calls parsed from token ids, one parser per model family."""
