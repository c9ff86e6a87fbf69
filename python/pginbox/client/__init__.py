"""The client of schema inbox: Inbox, AsyncInbox, the typed outcomes and the retry policy."""
