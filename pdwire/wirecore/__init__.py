"""Package marker; see the README for what lives here."""
