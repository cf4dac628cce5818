"""hivemind users switch by changing an import: hivemind-style calls and checks against peer."""
