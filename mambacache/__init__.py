"""mambacache."""
