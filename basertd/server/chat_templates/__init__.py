"""Chat templates shipped with basertd (Jinja files read by ``basertd.server.chat_template``)."""
