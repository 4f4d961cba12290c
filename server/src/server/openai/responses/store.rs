//! What `previous_response_id` continues from: each response's
//! conversation (its messages, the assistant's answer last) and the
//! encoding of its prompt, so the next turn tokenizes and reads only its
//! new part; the KV state itself is in the engine's prefix cache, under the
//! conversation's owner.
//!
//! Three lifetimes:
//! * a socket's own responses live as long as the socket (`store: false`
//!   ones only there, as OpenAI's WebSocket mode keeps them);
//! * when the socket goes, they are parked for the session TTL, so a client
//!   that reconnects continues where it was (as `/v1/ws`'s resume);
//! * `store: true` responses are kept server-wide for an hour after their
//!   last use (bounded by count), for any socket or HTTP request of the
//!   same tenant.
//!
//! Stored responses also keep what `GET /v1/responses/{id}` and its
//! `input_items` show ([`Record`]).
//!
//! Lookups are by tenant: another bearer token's response id is not found.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use moka::sync::Cache;
use protocol::ChatMessage;
use serde_json::Value;

use crate::tokenizer::PieceEncoding;

/// How long a stored response is kept after its last use.
const STORED_IDLE: Duration = Duration::from_secs(3600);
/// Most responses kept server-wide, stored and parked each.
const MAX_KEPT: u64 = 100_000;

/// A response's conversation, from its first message to its answer.
pub struct Conversation {
    /// The bearer token's tenant it belongs to.
    pub tenant: String,
    /// Whose prefix-cache entries hold its KV state.
    pub owner: String,
    /// The conversation before this turn (its previous response's), shared
    /// rather than copied, so a long chain costs each turn's messages once.
    pub earlier: Option<Arc<Conversation>>,
    /// This turn's input messages and the answer.
    pub messages: Vec<ChatMessage>,
    /// The encoding of this turn's prompt, which the next prompt extends.
    pub encoding: Option<Arc<PieceEncoding>>,
    /// What a stored (`store: true`) response shows when read back.
    pub record: Option<Record>,
}

/// A stored response as the API reads it back.
pub struct Record {
    /// The final response object.
    pub response: Value,
    /// This turn's input items, with their ids.
    pub input_items: Vec<Value>,
}

impl Conversation {
    /// Every message, oldest first.
    pub fn all_messages(&self) -> Vec<ChatMessage> {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(c) = at {
            chain.push(c);
            at = c.earlier.as_deref();
        }
        chain.iter().rev().flat_map(|c| c.messages.iter().cloned()).collect()
    }
}

/// A socket's own responses.
pub type SocketResponses = Mutex<HashMap<String, Arc<Conversation>>>;

pub struct ResponseStore {
    stored: Cache<String, Arc<Conversation>>,
    parked: Cache<String, Arc<Conversation>>,
}

impl ResponseStore {
    pub fn new(session_ttl: Duration) -> ResponseStore {
        ResponseStore {
            stored: Cache::builder().max_capacity(MAX_KEPT).time_to_idle(STORED_IDLE).build(),
            parked: Cache::builder().max_capacity(MAX_KEPT).time_to_live(session_ttl).build(),
        }
    }

    /// `id`'s conversation, if `tenant` may continue it: the socket's own
    /// first, then parked and stored ones.
    pub fn find(&self, tenant: &str, id: &str, socket: Option<&SocketResponses>) -> Option<Arc<Conversation>> {
        let own = socket.and_then(|s| s.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned());
        own.or_else(|| self.parked.get(id)).or_else(|| self.stored.get(id)).filter(|c| c.tenant == tenant)
    }

    /// Keeps a finished response: on its socket, and server-wide when `store`.
    pub fn keep(&self, id: &str, conversation: Arc<Conversation>, store: bool, socket: Option<&SocketResponses>) {
        if let Some(s) = socket {
            s.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), conversation.clone());
        }
        if store {
            self.stored.insert(id.to_string(), conversation);
        }
    }

    /// A stored response of `tenant`'s, to read back.
    pub fn stored(&self, tenant: &str, id: &str) -> Option<Arc<Conversation>> {
        self.stored.get(id).filter(|c| c.tenant == tenant && c.record.is_some())
    }

    /// Forgets a stored response of `tenant`'s; false when there is none.
    /// A socket that holds it may still continue it while it is open.
    pub fn delete(&self, tenant: &str, id: &str) -> bool {
        self.stored(tenant, id).is_some() && self.stored.remove(id).is_some()
    }

    /// A socket closed: its responses wait a session TTL for a reconnect.
    pub fn park(&self, socket: &SocketResponses) {
        for (id, c) in socket.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            self.parked.insert(id, c);
        }
    }
}
