// ObservableKit — ordered delivery without holding the producer's lock.
//
// A "turnstile": producers enqueue items in order (typically while holding the lock that
// assigned the item's revision) and then call `drain()` after releasing it. At most one
// thread drains at a time; it delivers every queued item in order, including items
// enqueued while it was delivering. A callback that produces a new item (a write from
// inside an observer) enqueues it and returns; the running drainer delivers it next. So
// delivery is ordered, never recursive, and never happens under the producer's lock.


/// Delivers items in the order they were enqueued, one deliverer at a time.
public final class SerialDeliveryQueue<Item: Sendable>: Sendable {
    private struct State: Sendable {
        var items: [Item] = []
        var draining = false
    }

    private let state = Locked(State())
    private let deliver: @Sendable (Item) -> Void

    /// Creates a queue that hands each item to `deliver`, in order.
    public init(deliver: @escaping @Sendable (Item) -> Void) {
        self.deliver = deliver
    }

    /// Appends an item. Cheap; never delivers. Call `drain()` afterwards.
    public func enqueue(_ item: Item) {
        state.withLock { $0.items.append(item) }
    }

    /// Delivers queued items unless another thread is already doing so — in which case
    /// that thread will deliver them, and this call returns at once.
    public func drain() {
        var batch: [Item] = state.withLock { s in
            if s.draining || s.items.isEmpty { return [] }
            s.draining = true
            return Self.take(&s.items)
        }
        while !batch.isEmpty {
            for item in batch { deliver(item) }
            batch = state.withLock { s in
                if s.items.isEmpty {
                    s.draining = false
                    return []
                }
                return Self.take(&s.items)
            }
        }
    }

    /// The number of items waiting to be delivered.
    public var pending: Int { state.withLock { $0.items.count } }

    private static func take(_ items: inout [Item]) -> [Item] {
        var taken: [Item] = []
        swap(&taken, &items)
        return taken
    }
}
