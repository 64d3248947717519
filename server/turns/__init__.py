"""The turn service in parts: which release serves, the conversations, the pipeline of one turn,
the agent loop and its generation step, resends, feedback and the rate limit.
``server.chat.ChatService`` puts them together for the front ends."""
