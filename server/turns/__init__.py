"""The turn service in parts: which release serves, the conversations and their group committer,
the pipeline of one turn (an ``ActiveTurn``), the agent loop and its generation step, the items a
turn streams, resends, feedback and the rate limit. ``server.chat.ChatService`` puts them
together for the front ends."""
