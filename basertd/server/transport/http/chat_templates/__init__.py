"""Chat templates shipped with basertd (Jinja files read by
``basertd.server.transport.http.chat_template``)."""
